//! The compile driver: manifest -> imported model -> graph -> passes, shared by the CLI and tests.

use std::path::Path;

use crate::builders::build_graph;
use crate::error::Result;
use crate::graph::Graph;
use crate::import::{import, ImportedModel};
use crate::manifest::LoadedManifest;
use crate::passes::{run_pipeline, PipelineOptions};

/// A model imported and lowered to an optimized graph.
#[derive(Debug)]
pub struct Frontend {
    pub manifest: LoadedManifest,
    pub model: ImportedModel,
    pub graph: Graph,
}

/// Imports the manifest's model and runs the graph pipeline.
pub fn frontend(manifest: LoadedManifest, options: &PipelineOptions<'_>) -> Result<Frontend> {
    let m = &manifest.manifest;
    let model = import(&m.model.path, m.model.architecture.as_deref())?;
    let mut graph = build_graph(&model)?;
    run_pipeline(&mut graph, options)?;
    Ok(Frontend { manifest, model, graph })
}

/// One optimized graph per device of a mesh of `devices` (the shard pass gives
/// each its slice of the model; one device: the plain pipeline). With
/// `--dump-ir DIR`, device `i`'s passes go to `DIR/device<i>/` on a mesh.
pub fn device_graphs(model: &ImportedModel, devices: u32, split_attention: bool, options: &PipelineOptions<'_>) -> Result<Vec<Graph>> {
    let base = build_graph(model)?;
    let mut graphs = Vec::with_capacity(devices as usize);
    for index in 0..devices {
        let mut graph = base.clone();
        let dump_dir = options.dump_dir.map(|d| if devices > 1 { d.join(format!("device{index}")) } else { d.to_path_buf() });
        let shard = (devices > 1).then_some(crate::sharding::ShardTarget { index, devices, split_attention });
        run_pipeline(&mut graph, &PipelineOptions { dump_dir: dump_dir.as_deref(), shard, ..options.clone() })?;
        graphs.push(graph);
    }
    Ok(graphs)
}

/// The graphs `--stop-after` shows: one per device of the manifest's (or
/// `devices`') mesh, after the pipeline up to the named pass.
pub fn frontend_graphs(manifest: &LoadedManifest, devices: Option<&str>, attention: Option<&str>, options: &PipelineOptions<'_>) -> Result<Vec<Graph>> {
    let shown = manifest.source.clone().unwrap_or_else(|| std::path::PathBuf::from("<--model>"));
    let m = &manifest.manifest;
    let model = import(&m.model.path, m.model.architecture.as_deref())?;
    let devices = devices.map(str::to_string).or(m.compile.devices.clone());
    let attention = attention.map(str::to_string).or(m.compile.attention_sharding.clone());
    let (mesh, split, _) = plan_mesh(&shown, devices.as_deref(), attention.as_deref(), &model.config)?;
    if options.stop_after == Some("shard") && mesh.len() < 2 {
        return Err(crate::Error::Flag { flag: "--stop-after".into(), message: "the shard pass runs on a mesh only; add --devices cpu:0,1".into() });
    }
    device_graphs(&model, mesh.len() as u32, split, options)
}

/// The mesh and attention policy a compile asks for (flags over the manifest),
/// checked against the model: a mesh that cannot split it is an error naming the
/// config field, its value and the device count. Returns the mesh, whether
/// attention is split by heads, and notes for the user.
pub fn plan_mesh(
    shown: &Path,
    devices: Option<&str>,
    attention: Option<&str>,
    cfg: &crate::import::ModelConfig,
) -> Result<(maxrun::format::DeviceMesh, bool, Vec<String>)> {
    use crate::error::Error;
    use crate::sharding::{parse_mesh, AttentionSharding};
    let mesh = parse_mesh(devices.unwrap_or("cpu")).map_err(|m| Error::invalid(shown, "compile.devices", m))?;
    let policy = AttentionSharding::parse(attention.unwrap_or("auto")).map_err(|m| Error::invalid(shown, "compile.attention_sharding", m))?;
    let n = mesh.len() as u64;
    let mut notes = Vec::new();
    if n < 2 {
        return Ok((mesh, false, notes));
    }
    let field = |m: String| Err(Error::invalid(shown, "compile.devices", m));
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
    Ok((mesh, split, notes))
}

/// What becomes of a checkpoint's matrices stored in GGUF block types that maxc
/// has no kernels for, under the linear layers' encoding `named`, for the user.
fn block_storage_notes(path: &Path, weights: &crate::import::WeightStore, named: &str) -> Vec<String> {
    use crate::import::StorageType;
    let mut counts: std::collections::BTreeMap<&'static str, (StorageType, usize)> = Default::default();
    for name in weights.names() {
        let entry = weights.get(name).expect("a listed tensor");
        if entry.shape.len() == 2 && entry.storage.native_scheme().is_none() && entry.storage != StorageType::F32 {
            counts.entry(entry.storage.name()).or_insert((entry.storage, 0)).1 += 1;
        }
    }
    if counts.is_empty() {
        return Vec::new();
    }
    let file = path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
    let listed = counts.iter().map(|(name, (_, n))| format!("{n} {name}")).collect::<Vec<_>>().join(", ");
    let fate = if named == crate::quant::STORED {
        let widened = |q: crate::graph::QuantScheme| counts.values().any(|(t, _)| crate::quant::stored_scheme(*t) == q);
        let mut fates = Vec::new();
        if widened(crate::graph::QuantScheme::Q8_0) {
            fates.push("q8_0 (5- and 6-bit blocks)");
        }
        if widened(crate::graph::QuantScheme::Q4K) {
            fates.push("q4_k (2- and 3-bit blocks)");
        }
        format!("{}, the nearest more precise encoding with kernels (--quantization-encoding names another)", fates.join(" and "))
    } else {
        named.to_string()
    };
    vec![format!("{file}: {listed} matrices have no kernels in maxc; they are dequantized exactly, then encoded as {fate}")]
}

/// Loads a manifest file, or the default manifest for `--model PATH`.
pub fn load_manifest(manifest: Option<&Path>, model: Option<&Path>, overrides: &[String]) -> Result<LoadedManifest> {
    match (manifest, model) {
        (Some(m), _) => LoadedManifest::from_file(m, overrides),
        (None, Some(p)) => LoadedManifest::from_model_path(p, overrides),
        (None, None) => Err(crate::Error::Flag {
            flag: "MANIFEST".into(),
            message: "give a manifest file or --model PATH".into(),
        }),
    }
}

/// Options of `maxc compile` beyond the manifest.
#[derive(Debug, Clone, Default)]
pub struct CompileOptions<'a> {
    /// `--target`, overriding the manifest's `compile.target`.
    pub target: Option<String>,
    /// The command line, recorded in the artifact's provenance.
    pub flags: Vec<String>,
    pub pipeline: PipelineOptions<'a>,
    /// Write the kernels' optimized LLVM IR to this directory.
    pub emit_llvm: Option<std::path::PathBuf>,
    /// Write each GPU architecture's PTX module to this directory (`<arch>.ptx`).
    pub emit_ptx: Option<std::path::PathBuf>,
    /// `--quantization-encoding`, overriding the manifest's.
    pub encoding: Option<String>,
    /// `--embedding-encoding`, overriding the manifest's.
    pub embedding_encoding: Option<String>,
    /// `--activation-encoding`, overriding the manifest's.
    pub activation_encoding: Option<String>,
    /// `--kv-cache-encoding`, overriding the manifest's.
    pub kv_cache_encoding: Option<String>,
    /// `--backend`: `llvm` (default) or `cranelift`.
    pub backend: Option<String>,
    /// `--devices`, overriding the manifest's `compile.devices`.
    pub devices: Option<String>,
    /// `--attention-sharding`, overriding the manifest's.
    pub attention_sharding: Option<String>,
    /// Show progress on stderr (bars on a terminal, "still compiling" lines).
    pub progress: bool,
}

/// What a compile produced.
#[derive(Debug, Clone)]
pub struct CompileReport {
    pub artifact_bytes: u64,
    pub kernels: usize,
    pub prefill_launches: usize,
    pub decode_launches: usize,
    pub prefill_arena_bytes: u64,
    pub decode_arena_bytes: u64,
    /// Each phase, in order: (name, wall seconds, peak resident bytes so far).
    pub phases: Vec<(&'static str, f64, u64)>,
    /// Decisions the user should know about (e.g. attention replicated on a mesh).
    pub notes: Vec<String>,
}

/// The process's peak resident set size (VmHWM), 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map_or(0, |kb| kb * 1024)
}

/// The largest prefill step; longer prompts run in chunks of this many tokens.
pub const PREFILL_CHUNK: u64 = 128;
/// What maxrun will use at run time, checked now rather than failing there: the
/// special token ids are inside the vocabulary, and the chat template (if any)
/// renders a conversation of user, assistant and user messages with the
/// generation prompt.
fn check_runtime_inputs(model: &crate::import::ImportedModel) -> Result<()> {
    let cfg = &model.config;
    let vocab = cfg.vocab_size;
    let ids = cfg.bos_token_id.iter().map(|&id| ("bos_token_id", id)).chain(cfg.eos_token_ids.iter().map(|&id| ("eos_token_id", id)));
    for (field, id) in ids {
        if id as usize >= vocab {
            return Err(crate::Error::invalid(&model.source, field, format!("{id} is outside the vocabulary of {vocab} tokens")));
        }
    }
    if let Some(template) = model.chat_template.as_deref() {
        use maxrun::chat::{render, Message};
        let conversation = [Message::new("user", "Hello"), Message::new("assistant", "Hi."), Message::new("user", "How are you?")];
        if let Err(e) = render(template, &conversation, true, "<s>", "</s>") {
            return Err(crate::Error::invalid(
                &model.source,
                "chat_template",
                format!("does not render a conversation (user, assistant, user): {e:#}; fix the template, or remove it (then `maxrun --chat` and /v1/chat/completions are unavailable)"),
            ));
        }
    }
    Ok(())
}

/// The default `max_length` cap when the manifest sets none.
pub const DEFAULT_MAX_LENGTH: u64 = 4096;
/// Positions per block of the batched engine's paged KV cache (vLLM's default).
pub const KV_BLOCK_SIZE: u64 = 16;
/// The batched engine's rows per step when `compile.max_batch_tokens` is not set.
pub const DEFAULT_MAX_BATCH_TOKENS: u64 = 256;
/// The batched engine's sequences per step when `compile.max_sequences` is not set.
pub const DEFAULT_MAX_SEQUENCES: u64 = 16;

/// The batched engine's limits (`compile.max_batch_tokens`, `compile.max_sequences`)
/// for an artifact of `max_length` positions; `None` where there are no batch
/// plans (a mesh of several devices, an encoder).
pub fn batch_limits(shown: &Path, c: &crate::manifest::CompileSection, max_length: u64, devices: u32, encoder: bool) -> Result<Option<maxrun::format::BatchLimits>> {
    let max_sequences = c.max_sequences.map_or(DEFAULT_MAX_SEQUENCES, u64::from);
    let max_rows = c.max_batch_tokens.map_or(DEFAULT_MAX_BATCH_TOKENS.max(max_sequences), u64::from);
    if max_rows < max_sequences {
        return Err(crate::Error::invalid(
            shown,
            "compile.max_batch_tokens",
            format!("{max_rows} rows per step cannot hold a decode row for each of compile.max_sequences = {max_sequences} sequences; raise it to at least {max_sequences}"),
        ));
    }
    if devices > 1 || encoder {
        return Ok(None);
    }
    Ok(Some(maxrun::format::BatchLimits { block_size: KV_BLOCK_SIZE, blocks_per_sequence: max_length.div_ceil(KV_BLOCK_SIZE), max_rows, max_sequences }))
}

/// Compiles the manifest's model into an artifact at `output`.
pub fn compile(manifest: LoadedManifest, output: &Path, options: &CompileOptions<'_>) -> Result<CompileReport> {
    use crate::error::Error;
    use crate::schedule::{kv_shape, memory::plan_arena, schedule, Arg, KernelSet, Schedule, WeightTable};
    use maxc_kernels::library::SeqMode;
    use maxrun::format as mef;

    let shown = manifest.source.clone().unwrap_or_else(|| std::path::PathBuf::from("<--model>"));
    let c = manifest.manifest.compile.clone();
    // A GGUF keeps its blocks unless told otherwise (as MAX infers the encoding
    // from GGUF weights); other checkpoints compile to float32.
    let gguf = crate::import::is_gguf(&manifest.manifest.model.path);
    let encoding_name = options
        .encoding
        .clone()
        .or(c.quantization_encoding.clone())
        .unwrap_or_else(|| if gguf { crate::quant::STORED.into() } else { "float32".into() });
    let linear_encoding = crate::quant::parse_linear_encoding(&encoding_name).map_err(|m| Error::invalid(&shown, "compile.quantization_encoding", m))?;
    let m = &manifest.manifest;
    let model = import(&m.model.path, m.model.architecture.as_deref())?;
    // `stored`: each weight's encoding from its storage in the checkpoint.
    let stored: Option<std::sync::Arc<std::collections::HashMap<String, crate::graph::QuantScheme>>> = linear_encoding.is_none().then(|| {
        let w = &model.weights;
        std::sync::Arc::new(w.names().map(|n| (n.to_string(), crate::quant::stored_scheme(w.get(n).expect("a listed tensor").storage))).collect())
    });
    let encoding = linear_encoding.unwrap_or(crate::graph::QuantScheme::None);
    let embedding_encoding = match options.embedding_encoding.clone().or(c.embedding_encoding.clone()) {
        Some(name) => Some(crate::quant::parse_encoding(&name).map_err(|m| Error::invalid(&shown, "compile.embedding_encoding", m))?),
        None => None,
    };
    let activations_named = match options.activation_encoding.clone().or(c.activation_encoding.clone()) {
        Some(name) => Some(crate::manifest::parse_activation_encoding(&name).map_err(|m| Error::invalid(&shown, "compile.activation_encoding", m))?),
        None => None,
    };
    let kv_encoding = match options.kv_cache_encoding.clone().or(c.kv_cache_encoding.clone()) {
        Some(name) => crate::manifest::parse_kv_cache_encoding(&name).map_err(|m| Error::invalid(&shown, "compile.kv_cache_encoding", m))?,
        None => mef::KvEncoding::Float32,
    };
    let devices_spec = options.devices.clone().or(c.devices.clone());
    let target_spec = options.target.clone().or(c.target.clone()).unwrap_or_else(|| "cpu".into());
    // Without a mesh, one device of the kind the code targets.
    let devices_spec = devices_spec.or_else(|| (!target_spec.split(',').any(|t| t.trim().starts_with("cpu"))).then(|| "gpu:0".to_string()));
    let attention_spec = options.attention_sharding.clone().or(c.attention_sharding.clone());
    let targets = maxc_codegen::TargetSpec::parse(&target_spec)?;
    let cpu_spec = target_spec.split("cuda:").next().unwrap_or_default().trim_end_matches(',').to_string();
    let backend = options.backend.clone().unwrap_or_else(|| "llvm".into());
    let block_weights =
        encoding.is_block() || embedding_encoding.is_some_and(|e| e.is_block()) || stored.as_ref().is_some_and(|s| s.values().any(|q| q.is_block()));
    // The default: int16 activations where they can apply (block weights, CPU
    // code only), else float32 (docs/quantization.md, Int16 activations).
    let activations = activations_named.unwrap_or(if block_weights && targets.gpus.is_empty() {
        crate::schedule::ActivationEncoding::Int16
    } else {
        crate::schedule::ActivationEncoding::Float32
    });
    let integer_activations = activations != crate::schedule::ActivationEncoding::Float32;
    if integer_activations && !targets.gpus.is_empty() {
        return Err(Error::invalid(
            &shown,
            "compile.activation_encoding",
            format!("{} activations have CPU kernels only and `{target_spec}` has GPU code; use float32 (the default), or a cpu target", activations.name()),
        ));
    }
    if integer_activations && !block_weights {
        return Err(Error::invalid(
            &shown,
            "compile.activation_encoding",
            format!("{} activations multiply block-quantized weights, and `{encoding_name}` is not a block encoding; use --quantization-encoding q8_0, q4_0, q4_1 or q4_k", activations.name()),
        ));
    }
    if options.emit_ptx.is_some() && targets.gpus.is_empty() {
        return Err(Error::Flag { flag: "--emit-ptx".into(), message: format!("`{target_spec}` has no GPU part; add one, e.g. --target cpu,cuda:sm_90") });
    }
    match backend.as_str() {
        "llvm" => {}
        "cranelift" if targets.cpu.is_none() => {
            return Err(Error::Flag {
                flag: "--backend".into(),
                message: format!("cranelift compiles CPU code and `{target_spec}` has no CPU part (GPU code always goes through LLVM's NVPTX backend); use --backend llvm, or --target cpu,{target_spec}"),
            })
        }
        "cranelift" if cpu_spec == "cpu" || cpu_spec == "cpu:x86-64" => {}
        "cranelift" => {
            return Err(Error::Flag {
                flag: "--target".into(),
                message: format!("`{target_spec}`: the cranelift backend emits baseline x86-64 code; use --target cpu or cpu:x86-64, or --backend llvm"),
            })
        }
        other => return Err(Error::Flag { flag: "--backend".into(), message: format!("`{other}` is not a backend; backends: llvm, cranelift") }),
    }
    if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(Error::invalid(output, "-o", "the output directory does not exist"));
        }
    }

    let pipeline = PipelineOptions { encoding, embedding_encoding, stored, ..options.pipeline.clone() };
    let mut phases: Vec<(&'static str, f64, u64)> = Vec::new();
    let mut clock = std::time::Instant::now();
    let mut lap = |name: &'static str, phases: &mut Vec<(&'static str, f64, u64)>| {
        phases.push((name, clock.elapsed().as_secs_f64(), peak_rss_bytes()));
        clock = std::time::Instant::now();
    };
    let (mesh, split_attention, mut notes) = plan_mesh(&shown, devices_spec.as_deref(), attention_spec.as_deref(), &model.config)?;
    notes.extend(block_storage_notes(&m.model.path, &model.weights, &encoding_name));
    if mesh.kind == maxrun::format::DeviceKind::Gpu && targets.gpus.is_empty() {
        return Err(Error::invalid(&shown, "compile.devices", format!("`{}` needs GPU code; add it with --target cuda:sm_90 (or cpu,cuda:sm_90)", mesh.spec())));
    }
    if mesh.kind == maxrun::format::DeviceKind::Cpu && targets.cpu.is_none() {
        return Err(Error::invalid(&shown, "compile.devices", format!("`{}` needs CPU code but --target `{target_spec}` has none; add cpu, or use --devices gpu:0", mesh.spec())));
    }
    let devices = mesh.len() as u32;
    let graphs = device_graphs(&model, devices, split_attention, &pipeline)?;
    let fe = Frontend { manifest, model, graph: graphs[0].clone() };
    lap("import + graph passes", &mut phases);
    if options.pipeline.stop_after.is_some() {
        return Err(Error::Flag { flag: "--stop-after".into(), message: "stops before code generation; no artifact is written".into() });
    }
    let cfg = &fe.model.config;
    check_runtime_inputs(&fe.model)?;
    let max_length = c.max_length.map(u64::from).unwrap_or_else(|| (cfg.max_position_embeddings as u64).min(DEFAULT_MAX_LENGTH));
    // Encoders attend in both directions, so a sequence cannot be split into chunks.
    let max_seq = if cfg.encoder.is_some() { max_length } else { PREFILL_CHUNK.min(max_length) };
    let batch = batch_limits(&shown, &c, max_length, devices, cfg.encoder.is_some())?;

    let mut weights = WeightTable::default();
    weights.row_major_only = targets.cpu.is_none();
    weights.activations = activations;
    weights.register_tile = targets.cpu.as_ref().map(|t| maxc_kernels::library::RegisterTile::for_cpu(t.has_avx512())).unwrap_or_default();
    let mut kernels = KernelSet::default();
    let cache = crate::schedule::KvCacheSpec::new(max_length, kv_encoding);
    let mut schedules = Vec::with_capacity(graphs.len());
    for (index, graph) in graphs.iter().enumerate() {
        weights.device = index as u32;
        let mut interp = crate::interp::Interpreter::new(graph, &fe.model.weights);
        let prefill = schedule(graph, &mut interp, SeqMode::Dynamic, max_seq, cache, &mut weights, &mut kernels)?;
        let decode = schedule(graph, &mut interp, SeqMode::Fixed(1), 1, cache, &mut weights, &mut kernels)?;
        // Generation needs only the last token's logits of a prompt: a third plan stops
        // computing the other rows at the final norm (the lm_head is 14% of prefill).
        let cut = crate::schedule::last_row_cut(graph, &interp);
        let prefill_last = match cut {
            Some(cut) => Some(crate::schedule::schedule_last_row(graph, &mut interp, cut, max_seq, cache, &mut weights, &mut kernels)?),
            None => None,
        };
        // The batched engine's plans: a mixed step (prompt chunks beside decode
        // rows) and a decode step, both over a paged KV cache.
        let batch_plans = match (batch, cut) {
            (Some(b), Some(cut)) => {
                let paging = maxc_kernels::library::attention::Paging { block_size: b.block_size, blocks_per_seq: b.blocks_per_sequence };
                let mode = |decode, max_outputs| crate::schedule::BatchMode { paging, decode, max_outputs };
                let mixed = crate::schedule::schedule_batch(graph, &mut interp, cut, mode(false, b.max_sequences), b.max_rows, cache, &mut weights, &mut kernels)?;
                let decode = crate::schedule::schedule_batch(graph, &mut interp, cut, mode(true, b.max_sequences), b.max_sequences, cache, &mut weights, &mut kernels)?;
                let single = crate::schedule::schedule_batch(graph, &mut interp, cut, mode(true, 1), 1, cache, &mut weights, &mut kernels)?;
                Some((mixed, decode, single))
            }
            _ => None,
        };
        schedules.push((prefill, decode, prefill_last, batch_plans));
    }
    let batch = batch.filter(|_| schedules.iter().all(|s| s.3.is_some()));
    let kv = kv_shape(&fe.graph)?;

    let to_plan = |s: &Schedule| -> mef::Plan {
        let (offsets, arena_bytes) = plan_arena(&s.buffers);
        let arg = |a: &Arg| match *a {
            Arg::Buffer(b) => mef::BufferRef::Arena { offset: offsets[b as usize] },
            Arg::Weight(w) => mef::BufferRef::Weight(w),
            Arg::Tokens => mef::BufferRef::Tokens,
            Arg::Positions => mef::BufferRef::Positions,
            Arg::KeyCache(l) => mef::BufferRef::KeyCache(l),
            Arg::ValueCache(l) => mef::BufferRef::ValueCache(l),
            Arg::Slots => mef::BufferRef::Slots,
            Arg::RowSequences => mef::BufferRef::RowSequences,
            Arg::BlockTables => mef::BufferRef::BlockTables,
            Arg::LogitRows => mef::BufferRef::LogitRows,
        };
        let arena = |b: u32| mef::BufferRef::Arena { offset: offsets[b as usize] };
        mef::Plan {
            max_seq: s.max_seq,
            arena_bytes,
            launches: s
                .launches
                .iter()
                .map(|l| mef::Launch { kernel: l.kernel, args: l.args.iter().map(arg).collect(), tasks: l.tasks, output_elems: l.output_elems, rows: l.rows })
                .collect(),
            collectives: s
                .collectives
                .iter()
                .map(|c| mef::CollectiveStep { before_launch: c.before_launch as u32, op: c.op.clone(), input: arena(c.input), output: arena(c.output) })
                .collect(),
            logits: arena(s.logits),
        }
    };
    let kv_layout = mef::KvCacheLayout { layers: kv.layers, row_elems: kv.row_elems, encoding: kv_encoding };
    let sub_models: Vec<mef::SubModel> = schedules
        .iter()
        .enumerate()
        .map(|(d, (prefill, decode, last, batch))| mef::SubModel {
            name: if devices > 1 { format!("shard{d}") } else { "model".into() },
            device: format!("{}:{}", mesh.kind.name(), mesh.ordinals[d]),
            prefill: to_plan(prefill),
            decode: to_plan(decode),
            prefill_last: last.as_ref().map(to_plan),
            batch: batch.as_ref().map(|(mixed, decode, single)| mef::BatchPlans { mixed: to_plan(mixed), decode: to_plan(decode), single: to_plan(single) }),
            weight_bytes: 0,
            kv_bytes_per_token: kv_layout.bytes_per_token(),
        })
        .collect();
    let (prefill, decode) = (&schedules[0].0, &schedules[0].1);
    lap("schedule", &mut phases);
    if let Some(dir) = options.pipeline.dump_dir {
        let path = dir.join("launches.txt");
        let text = format!("{}{}", launch_summary("prefill", prefill, &kernels), launch_summary("decode", decode, &kernels));
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
    }

    if let (Some(dir), Some(target)) = (&options.emit_llvm, &targets.cpu) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let path = dir.join("kernels.ll");
        let ir = maxc_codegen::llvm::emit_llvm_ir(&kernels.kernels, target)?;
        std::fs::write(&path, ir).map_err(|e| Error::io(&path, e))?;
    }
    let ticker = crate::progress::Ticker::start(
        format!("{} kernels with {backend}", kernels.kernels.len()),
        std::time::Duration::from_secs(10),
        options.progress,
    );
    let (code, required_features, cpu, triple) = match &targets.cpu {
        None => (None, vec![], String::new(), String::new()),
        Some(target) if backend == "cranelift" => {
            let code = maxc_codegen::cranelift::compile_shared(&kernels.kernels)?;
            let features = maxc_codegen::cranelift::REQUIRED_FEATURES.iter().map(|f| f.to_string()).collect();
            (Some(code), features, "x86-64".to_string(), target.triple.clone())
        }
        Some(target) => {
            let code = maxc_codegen::llvm::compile_shared(&kernels.kernels, target)?;
            let explicit: Vec<String> =
                cpu_spec.split_once('+').map(|(_, f)| f.split(',').map(|x| x.trim().trim_start_matches('+').to_string()).collect()).unwrap_or_default();
            let features = target.enabled.iter().filter(|f| maxrun::cpu::is_checkable(f) || explicit.contains(f)).cloned().collect();
            (Some(code), features, target.cpu.clone(), target.triple.clone())
        }
    };
    // GPU modules: the same kernels through the NVPTX flavor of the LLVM emitter.
    // The GPU compiles each kernel's GPU form where the CPU one suits vector registers, not warps.
    let gpu_kernels = kernels.for_gpu();
    let ptx: Vec<String> = targets.gpus.iter().map(|g| maxc_codegen::llvm::compile_ptx(&gpu_kernels, g)).collect::<std::result::Result<_, _>>()?;
    if let Some(dir) = &options.emit_ptx {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        for (g, module) in targets.gpus.iter().zip(&ptx) {
            let path = dir.join(format!("{}.ptx", g.arch));
            std::fs::write(&path, module).map_err(|e| Error::io(&path, e))?;
        }
    }
    drop(ticker);
    lap("codegen + link", &mut phases);

    let mut provenance = mef::Provenance {
        maxc_version: env!("CARGO_PKG_VERSION").into(),
        maxc_git_revision: crate::provenance::GIT_REVISION.into(),
        target_spec: target_spec.clone(),
        build_id: String::new(),
        manifest: fe.manifest.text.clone(),
        flags: options.flags.clone(),
        inputs: fe.model.input_files.iter().map(|p| crate::provenance::hash_file(p)).collect::<Result<_>>()?,
    };
    provenance.build_id = crate::provenance::build_id(&provenance);
    let m = &fe.manifest.manifest;
    let g = &m.generation;
    let d = &fe.model.generation;
    let header = mef::Header {
        model: mef::ModelInfo {
            name: m.model.name.clone().unwrap_or_else(|| fe.model.name.clone()),
            architecture: cfg.architecture.hf_name().into(),
            vocab_size: cfg.vocab_size as u64,
            num_layers: cfg.num_layers as u64,
            embedding_width: cfg.encoder.map(|_| cfg.hidden_size as u64),
        },
        provenance: provenance.clone(),
        target: mef::TargetInfo { triple, cpu, required_features, backend: backend.clone() },
        sections: vec![],
        kernels: kernels
            .kernels
            .iter()
            .zip(&gpu_kernels)
            .map(|(k, gpu)| mef::KernelEntry {
                symbol: k.name.clone(),
                family: k.family.clone(),
                num_params: k.params.len() as u32,
                backend: backend.clone(),
                gpu_threads_per_task: maxc_kernels::warp::threads_per_task(gpu),
            })
            .collect(),
        weights: vec![],
        mesh: mesh.clone(),
        sub_models,
        kv_cache: kv_layout,
        tokenizer: mef::TokenizerInfo { bos_token_id: cfg.bos_token_id, eos_token_ids: cfg.eos_token_ids.clone() },
        generation: mef::GenerationDefaults {
            temperature: g.temperature.or(d.temperature),
            top_k: g.top_k.or(d.top_k),
            top_p: g.top_p.or(d.top_p),
            min_p: g.min_p.or(d.min_p),
            max_new_tokens: g.max_new_tokens.or(d.max_new_tokens),
        },
        max_length,
        gpu_archs: targets.gpus.iter().map(|g| g.arch.clone()).collect(),
        batch,
    };
    let report = CompileReport {
        artifact_bytes: 0,
        kernels: kernels.kernels.len(),
        prefill_launches: header.main().prefill.launches.len(),
        decode_launches: header.main().decode.launches.len(),
        prefill_arena_bytes: header.main().prefill.arena_bytes,
        decode_arena_bytes: header.main().decode.arena_bytes,
        phases: Vec::new(),
        notes,
    };
    let bytes = crate::mef_writer::write_artifact(
        output,
        crate::mef_writer::ArtifactContents {
            header,
            code: code.as_ref().map(|c| c.shared_object.as_slice()),
            ptx: &ptx,
            weights: &weights.slots,
            store: &fe.model.weights,
            tokenizer_json: &fe.model.tokenizer_json,
            chat_template: fe.model.chat_template.as_deref(),
            progress: options.progress,
        },
    )?;
    lap("write artifact", &mut phases);
    Ok(CompileReport { artifact_bytes: bytes, phases, ..report })
}

/// Every problem that would stop `compile`, found without generating code.
pub fn check(manifest: &LoadedManifest, target: Option<&str>) -> Vec<crate::Error> {
    use crate::error::Error;
    let shown = manifest.source.clone().unwrap_or_else(|| std::path::PathBuf::from("<--model>"));
    let c = &manifest.manifest.compile;
    let mut problems = Vec::new();
    if let Some(Err(m)) = c.quantization_encoding.as_deref().map(crate::quant::parse_linear_encoding) {
        problems.push(Error::invalid(&shown, "compile.quantization_encoding", m));
    }
    if let Some(Err(m)) = c.embedding_encoding.as_deref().map(crate::quant::parse_encoding) {
        problems.push(Error::invalid(&shown, "compile.embedding_encoding", m));
    }
    if let Err(m) = crate::sharding::parse_mesh(c.devices.as_deref().unwrap_or("cpu")) {
        problems.push(Error::invalid(&shown, "compile.devices", m));
    }
    let spec = target.map(str::to_string).or(c.target.clone()).unwrap_or_else(|| "cpu".into());
    if let Err(e) = maxc_codegen::TargetSpec::parse(&spec) {
        problems.push(e.into());
    }
    // The batch limits depend on the model only through which plans exist.
    if let Err(e) = batch_limits(&shown, c, c.max_length.map_or(DEFAULT_MAX_LENGTH, u64::from), 1, false) {
        problems.push(e);
    }
    let m = &manifest.manifest;
    let model = match import(&m.model.path, m.model.architecture.as_deref()) {
        Ok(model) => model,
        Err(e) => {
            problems.push(e);
            return problems;
        }
    };
    if let Err(e) = plan_mesh(&shown, c.devices.as_deref(), c.attention_sharding.as_deref(), &model.config) {
        if crate::sharding::parse_mesh(c.devices.as_deref().unwrap_or("cpu")).is_ok() {
            problems.push(e);
        }
    }
    let weight_problems = crate::builders::check_weights(&model);
    if !weight_problems.is_empty() {
        problems.extend(weight_problems);
        return problems;
    }
    let result = crate::builders::build_graph(&model).and_then(|mut g| {
        run_pipeline(&mut g, &PipelineOptions::default())?;
        let mut interp = crate::interp::Interpreter::new(&g, &model.weights);
        let (mut w, mut k) = (Default::default(), Default::default());
        let cache = crate::schedule::KvCacheSpec { max_len: 1, elem: maxc_kernels::ElemType::F32 };
        crate::schedule::schedule(&g, &mut interp, maxc_kernels::library::SeqMode::Fixed(1), 1, cache, &mut w, &mut k)?;
        crate::schedule::kv_shape(&g).map(|_| ())
    });
    if let Err(e) = result {
        problems.push(e);
    }
    problems
}

/// "`plan`: N launches, P per layer + R" and a histogram by kernel family, for `--dump-ir`.
fn launch_summary(plan: &str, s: &crate::schedule::Schedule, kernels: &crate::schedule::KernelSet) -> String {
    let family = |i: usize| kernels.kernels[s.launches[i].kernel as usize].family.as_str();
    let attention: Vec<usize> = (0..s.launches.len()).filter(|&i| family(i) == "attention").collect();
    let per_layer = attention.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    let rest = s.launches.len() - per_layer * attention.len();
    let mut families = std::collections::BTreeMap::new();
    for i in 0..s.launches.len() {
        *families.entry(family(i)).or_insert(0) += 1;
    }
    let hist: Vec<String> = families.iter().map(|(f, n)| format!("{f} {n}")).collect();
    format!("{plan}: {} launches, {per_layer} per layer + {rest} ({})\n", s.launches.len(), hist.join(", "))
}
