//! The compile driver: manifest -> imported model -> graph -> passes, shared by the CLI and tests.

use std::path::Path;

use crate::builders::build_graph;
use crate::compile_config::{Backend, CompileConfig, ModelPlan};
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

/// The graphs `--stop-after` shows: one per device of the configured mesh,
/// after the pipeline up to the named pass.
pub fn frontend_graphs(manifest: &LoadedManifest, options: &PipelineOptions<'_>) -> Result<Vec<Graph>> {
    let config = CompileConfig::resolve(manifest).map_err(first)?;
    let m = &manifest.manifest;
    let model = import(&m.model.path, m.model.architecture.as_deref())?;
    let plan = config.plan_for(manifest, &model).map_err(first)?;
    if options.stop_after == Some("shard") && plan.mesh.len() < 2 {
        return Err(crate::Error::Flag { flag: "--stop-after".into(), message: "the shard pass runs on a mesh only; add --devices cpu:0,1".into() });
    }
    device_graphs(&model, plan.mesh.len() as u32, plan.split_attention, options)
}

/// Options of `maxc compile` beyond the manifest (flags that set `[compile]`
/// keys arrive in the manifest: `manifest::FlagSetting`).
#[derive(Debug, Clone, Default)]
pub struct CompileOptions<'a> {
    /// The command line, recorded in the artifact's provenance.
    pub flags: Vec<String>,
    pub pipeline: PipelineOptions<'a>,
    /// Write the kernels' optimized LLVM IR to this directory.
    pub emit_llvm: Option<std::path::PathBuf>,
    /// Write each GPU architecture's PTX module to this directory (`<arch>.ptx`).
    pub emit_ptx: Option<std::path::PathBuf>,
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
    /// Each phase, in order.
    pub phases: Vec<Phase>,
    /// Decisions the user should know about (e.g. attention replicated on a mesh).
    pub notes: Vec<String>,
}

/// One phase of a compile: its wall time and memory.
#[derive(Debug, Clone)]
pub struct Phase {
    pub name: &'static str,
    pub wall_s: f64,
    /// The process's peak resident set so far (VmHWM: mapped checkpoint pages included).
    pub peak_rss_bytes: u64,
    /// The peak anonymous resident memory during the phase (sampled,
    /// `resident::AnonPeak`): what the compile itself holds.
    pub peak_anon_bytes: u64,
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
        use maxrun_runtime::chat::{render, Message};
        let conversation = [Message::new("user", "Hello"), Message::new("assistant", "Hi."), Message::new("user", "How are you?")];
        let rendered = render(template, &conversation, true, "<s>", "</s>").map_err(|e| format!("{e:#}"));
        let rendered = rendered.and_then(|text| match conversation.iter().find(|m| !text.contains(m.content.as_str())) {
            Some(m) => Err(format!("the rendered prompt leaves out the {} message {:?}", m.role, m.content)),
            None => Ok(text),
        });
        if let Err(e) = rendered {
            return Err(crate::Error::invalid(
                &model.source,
                "chat_template",
                format!("does not render a conversation (user, assistant, user): {e}; fix the template, or remove it (then `maxrun --chat` and /v1/chat/completions are unavailable)"),
            ));
        }
    }
    Ok(())
}

/// The first of a list of problems (what `compile` reports; `check` lists them all).
fn first(mut problems: Vec<crate::Error>) -> crate::Error {
    problems.remove(0)
}

/// Compiles the manifest's model into an artifact at `output`, in phases:
/// resolve the configuration, import and run the graph passes per device,
/// schedule, generate code, write.
pub fn compile(manifest: LoadedManifest, output: &Path, options: &CompileOptions<'_>) -> Result<CompileReport> {
    use crate::error::Error;
    let config = CompileConfig::resolve(&manifest).map_err(first)?;
    if options.emit_ptx.is_some() && config.targets.gpus.is_empty() {
        return Err(Error::Flag { flag: "--emit-ptx".into(), message: format!("`{}` has no GPU part; add one, e.g. --target cpu,cuda:sm_90", config.target_spec) });
    }
    if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(Error::invalid(output, "-o", "the output directory does not exist"));
        }
    }
    let mut phases: Vec<Phase> = Vec::new();
    let mut clock = std::time::Instant::now();
    let anon = crate::resident::AnonPeak::start();
    let mut lap = |name: &'static str, phases: &mut Vec<Phase>| {
        let (peak_rss_bytes, peak_anon_bytes) = (crate::resident::peak_rss_bytes(), anon.phase_peak());
        phases.push(Phase { name, wall_s: clock.elapsed().as_secs_f64(), peak_rss_bytes, peak_anon_bytes });
        clock = std::time::Instant::now();
    };

    let m = &manifest.manifest;
    let model = import(&m.model.path, m.model.architecture.as_deref())?;
    let plan = config.plan_for(&manifest, &model).map_err(first)?;
    let pipeline = PipelineOptions { encoding: plan.encoding, embedding_encoding: config.embedding_encoding, stored: plan.stored.clone(), ..options.pipeline.clone() };
    let graphs = device_graphs(&model, plan.mesh.len() as u32, plan.split_attention, &pipeline)?;
    lap("import + graph passes", &mut phases);
    if options.pipeline.stop_after.is_some() {
        return Err(Error::Flag { flag: "--stop-after".into(), message: "stops before code generation; no artifact is written".into() });
    }
    check_runtime_inputs(&model)?;

    let scheduled = schedule_devices(&graphs, &model, &config, &plan)?;
    lap("schedule", &mut phases);
    if let Some(dir) = options.pipeline.dump_dir {
        let path = dir.join("launches.txt");
        let (prefill, decode) = (&scheduled.schedules[0].0, &scheduled.schedules[0].1);
        let mut text = format!("{}{}", launch_summary("prefill", prefill, &scheduled.kernels), launch_summary("decode", decode, &scheduled.kernels));
        if let Some((encode, _)) = &scheduled.encode_batch[0] {
            text.push_str(&launch_summary("encode_batch", encode, &scheduled.kernels));
        }
        std::fs::write(&path, text).map_err(|e| Error::write(&path, e))?;
        dump_kernels(&dir.join("kernels"), &scheduled.kernels.kernels)?;
        // The kernels as the GPU runs them (each replaced by its GPU form), under
        // the CPU kernels' names: what a simulated GPU interprets.
        if !config.targets.gpus.is_empty() {
            dump_kernels(&dir.join("kernels-gpu"), &scheduled.kernels.for_gpu())?;
        }
    }

    let code = generate_code(&config, &scheduled.kernels, options)?;
    lap("codegen + link", &mut phases);
    let variants = other_cpu_variants(&graphs, &model, &config, &plan, &scheduled, options)?;
    if !variants.is_empty() {
        lap("other CPU variants", &mut phases);
    }

    let fe = Frontend { manifest, model, graph: graphs.into_iter().next().expect("one graph per device") };
    let mut header = build_header(&fe, &config, &plan, &scheduled, &code, options)?;
    header.cpu_variants = variants.iter().map(|(c, s, g)| cpu_variant(c, &plan, s, g)).collect();
    let variant_code: Vec<&[u8]> = variants.iter().map(|(_, _, g)| g.shared_object.as_deref().expect("CPU variants have CPU code")).collect();
    let report = CompileReport {
        artifact_bytes: 0,
        kernels: scheduled.kernels.kernels.len(),
        prefill_launches: header.main().prefill.launches.len(),
        decode_launches: header.main().decode.launches.len(),
        prefill_arena_bytes: header.main().prefill.arena_bytes,
        decode_arena_bytes: header.main().decode.arena_bytes,
        phases: Vec::new(),
        notes: plan.notes.clone(),
    };
    let bytes = crate::mef_writer::write_artifact(
        output,
        crate::mef_writer::ArtifactContents {
            header,
            code: code.shared_object.as_deref(),
            variant_code: &variant_code,
            ptx: &code.ptx,
            weights: &scheduled.weights.slots,
            store: &fe.model.weights,
            tokenizer_json: &fe.model.tokenizer_json,
            chat_template: fe.model.chat_template.as_deref(),
            progress: options.progress,
        },
    )?;
    lap("write artifact", &mut phases);
    Ok(CompileReport { artifact_bytes: bytes, phases, ..report })
}

/// The further CPU variants of a multi-ISA target, each scheduled (its
/// register tile gives its own kernels and plans) and compiled. Their weights
/// must be laid out as the first variant's, which the artifact stores once:
/// layouts depend on whether there is CPU code and on the activations, never
/// on the ISA level, and a difference is an error rather than a second copy.
fn other_cpu_variants(
    graphs: &[Graph],
    model: &ImportedModel,
    config: &CompileConfig,
    plan: &ModelPlan,
    first: &Scheduled,
    options: &CompileOptions<'_>,
) -> Result<Vec<(CompileConfig, Scheduled, GeneratedCode)>> {
    let quiet = CompileOptions { emit_llvm: None, emit_ptx: None, ..options.clone() };
    let mut variants = Vec::new();
    for variant in config.other_cpu_variants() {
        let scheduled = schedule_devices(graphs, model, &variant, plan)?;
        if scheduled.weights.slots != first.weights.slots {
            let differ = first.weights.slots.iter().zip(&scheduled.weights.slots).find(|(a, b)| a != b).map_or_else(|| "the number of weights".to_string(), |(a, _)| format!("`{}`", a.name));
            return Err(crate::Error::invalid(
                &config.shown,
                "compile.target",
                format!("CPU variant `{}` lays out {differ} unlike `{}`, and the variants of one artifact share one copy of the weights; compile one artifact per variant", variant.cpu_spec, config.cpu_spec),
            ));
        }
        let mut code = generate_code(&variant, &scheduled.kernels, &quiet)?;
        // The GPU modules come with the first variant only.
        code.ptx.clear();
        variants.push((variant, scheduled, code));
    }
    Ok(variants)
}

/// Every device's plans: (prefill, decode, last-row prefill, batch plans:
/// mixed, decode, single), with the weights table and kernels they share.
pub struct Scheduled {
    pub schedules: Vec<(crate::schedule::Schedule, crate::schedule::Schedule, Option<crate::schedule::Schedule>, Option<BatchSchedules>)>,
    pub weights: crate::schedule::WeightTable,
    pub kernels: crate::schedule::KernelSet,
    /// The batch limits when every device has batch plans.
    pub batch: Option<maxc_format::BatchLimits>,
    /// Per device: a sentence encoder's batch plan and its limits.
    pub encode_batch: Vec<Option<(crate::schedule::Schedule, crate::compile_config::EncodeLimits)>>,
    pub kv: crate::schedule::KvShape,
    pub max_length: u64,
    /// A mixture of experts' routing and expert bytes (`maxrun inspect`).
    pub experts: Option<maxc_format::ExpertsInfo>,
}

/// The routed experts of `graph` (its `moe` nodes): count, top-k, rule, layers,
/// and their weights' bytes as stored (layouts reorder a part, never resize it).
fn experts_info(graph: &Graph) -> Option<maxc_format::ExpertsInfo> {
    let moes: Vec<&crate::graph::Node> = graph.nodes.iter().filter(|n| matches!(n.op, crate::graph::Op::Moe { .. })).collect();
    let crate::graph::Op::Moe { experts, top_k, routing, .. } = moes.first()?.op else { unreachable!("filtered") };
    let bytes = |v: crate::graph::ValueId| {
        let ty = graph.ty(v);
        let shape: Vec<u64> = ty.shape.iter().map(|d| d.fixed().unwrap_or(0)).collect();
        ty.quant.bytes(&shape).unwrap_or(0)
    };
    let expert_bytes: u64 = moes.iter().map(|n| bytes(n.inputs[2]) + bytes(n.inputs[3])).sum();
    Some(maxc_format::ExpertsInfo {
        experts: experts as u64,
        top_k: top_k as u64,
        routing: routing.name().into(),
        routed_layers: moes.len() as u64,
        expert_bytes,
        active_expert_bytes: expert_bytes * top_k as u64 / experts as u64,
    })
}

/// The batched engine's plans of one device: mixed step, decode step, single sequence.
pub type BatchSchedules = (crate::schedule::Schedule, crate::schedule::Schedule, crate::schedule::Schedule);

/// Schedules every device's graph (kernels chosen, weights laid out, buffers
/// assigned), for `compile` and, without generating code, for `check`.
pub fn schedule_devices(graphs: &[Graph], model: &ImportedModel, config: &CompileConfig, plan: &ModelPlan) -> Result<Scheduled> {
    use crate::schedule::{kv_shape, schedule, KernelSet, WeightTable};
    use maxc_kernels::library::SeqMode;
    let cfg = &model.config;
    let max_length = plan.max_length;
    // Encoders attend in both directions, so a sequence cannot be split into chunks.
    let max_seq = if cfg.encoder.is_some() { max_length } else { PREFILL_CHUNK.min(max_length) };
    let mut weights = WeightTable::default();
    weights.row_major_only = config.targets.cpu.is_none();
    weights.activations = plan.activations;
    weights.register_tile = config.targets.cpu.as_ref().map(|t| maxc_kernels::library::RegisterTile::for_cpu(t.has_avx512())).unwrap_or_default();
    weights.q4_k_int8_tile = config.targets.cpu.as_ref().filter(|t| t.q4_k_int8_tiles_take_eight_rows()).map(|_| maxc_kernels::library::RegisterTile::ZMM_EIGHT_ROWS);
    weights.byte_dots_take_q8_0 = config.targets.cpu.as_ref().is_none_or(|t| t.multiplies_q8_0_bytes_directly());
    weights.tiles_take_word_pairs = config.targets.cpu.as_ref().is_some_and(|t| t.has_avx2() && !t.has_avx512() && !t.multiplies_q8_0_bytes_directly());
    let mut kernels = KernelSet::default();
    let cache = crate::schedule::KvCacheSpec::new(max_length, plan.kv_encoding, config.targets.cpu.is_some());
    let mut schedules = Vec::with_capacity(graphs.len());
    let mut encode_batch = Vec::with_capacity(graphs.len());
    for (index, graph) in graphs.iter().enumerate() {
        weights.device = index as u32;
        let mut interp = crate::interp::Interpreter::new(graph, &model.weights);
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
        let batch_plans = match (plan.batch, cut) {
            (Some(b), Some(cut)) => {
                let paging = maxc_kernels::library::attention::Paging { block_size: b.block_size, blocks_per_seq: b.blocks_per_sequence };
                let mode = |decode, max_outputs| crate::schedule::BatchMode::Paged { paging, decode, max_outputs };
                let mixed = crate::schedule::schedule_batch(graph, &mut interp, cut, mode(false, b.max_logit_rows), b.max_rows, cache, &mut weights, &mut kernels)?;
                let decode = crate::schedule::schedule_batch(graph, &mut interp, cut, mode(true, b.max_sequences), b.max_sequences, cache, &mut weights, &mut kernels)?;
                let single = crate::schedule::schedule_batch(graph, &mut interp, cut, mode(true, 1), 1, cache, &mut weights, &mut kernels)?;
                Some((mixed, decode, single))
            }
            _ => None,
        };
        schedules.push((prefill, decode, prefill_last, batch_plans));
        // A sentence encoder's batch plan: many whole inputs per step, no KV cache.
        encode_batch.push(match plan.encode_batch {
            Some(e) => Some((crate::schedule::schedule_encode_batch(graph, &mut interp, e.max_rows, e.max_sequences, cache, &mut weights, &mut kernels)?, e)),
            None => None,
        });
    }
    let batch = plan.batch.filter(|_| schedules.iter().all(|s| s.3.is_some()));
    let kv = kv_shape(&graphs[0])?;
    Ok(Scheduled { schedules, weights, kernels, batch, encode_batch, kv, max_length, experts: experts_info(&graphs[0]) })
}

/// The generated code: the CPU shared object (with the CPU it was tuned for,
/// its triple and the features it needs) and one PTX module per GPU architecture.
pub struct GeneratedCode {
    pub shared_object: Option<Vec<u8>>,
    pub required_features: Vec<String>,
    pub cpu: String,
    pub triple: String,
    pub ptx: Vec<String>,
    /// The kernels in the form the GPU compiles (`KernelSet::for_gpu`).
    pub gpu_kernels: Vec<maxc_kernels::Kernel>,
}

/// Generates the CPU code (LLVM or Cranelift) and the PTX modules, writing
/// `--emit-llvm` / `--emit-ptx` outputs on the way.
pub fn generate_code(config: &CompileConfig, kernels: &crate::schedule::KernelSet, options: &CompileOptions<'_>) -> Result<GeneratedCode> {
    use crate::error::Error;
    let targets = &config.targets;
    if let (Some(dir), Some(target)) = (&options.emit_llvm, &targets.cpu) {
        std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
        let path = dir.join("kernels.ll");
        let ir = maxc_codegen::llvm::emit_llvm_ir(&kernels.kernels, target)?;
        std::fs::write(&path, ir).map_err(|e| Error::write(&path, e))?;
    }
    let ticker = crate::progress::Ticker::start(
        format!("{} kernels with {}", kernels.kernels.len(), config.backend.name()),
        std::time::Duration::from_secs(10),
        options.progress,
    );
    let (shared_object, required_features, cpu, triple) = match &targets.cpu {
        None => (None, vec![], String::new(), String::new()),
        Some(target) if config.backend == Backend::Cranelift => {
            let code = maxc_codegen::cranelift::compile_shared(&kernels.kernels)?;
            let features = maxc_codegen::cranelift::REQUIRED_FEATURES.iter().map(|f| f.to_string()).collect();
            (Some(code.shared_object), features, "x86-64".to_string(), target.triple.clone())
        }
        Some(target) => {
            let code = maxc_codegen::llvm::compile_shared(&kernels.kernels, target)?;
            let explicit: Vec<String> =
                config.cpu_spec.split_once('+').map(|(_, f)| f.split(',').map(|x| x.trim().trim_start_matches('+').to_string()).collect()).unwrap_or_default();
            let features = target.enabled.iter().filter(|f| maxrun_runtime::cpu::is_checkable(f) || explicit.contains(f)).cloned().collect();
            (Some(code.shared_object), features, target.cpu.clone(), target.triple.clone())
        }
    };
    // GPU modules: the same kernels through the NVPTX flavor of the LLVM emitter.
    // The GPU compiles each kernel's GPU form where the CPU one suits vector registers, not warps.
    let gpu_kernels = kernels.for_gpu();
    let ptx: Vec<String> = targets.gpus.iter().map(|g| maxc_codegen::llvm::compile_ptx(&gpu_kernels, g)).collect::<std::result::Result<_, _>>()?;
    if let Some(dir) = &options.emit_ptx {
        std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
        for (g, module) in targets.gpus.iter().zip(&ptx) {
            let path = dir.join(format!("{}.ptx", g.arch));
            std::fs::write(&path, module).map_err(|e| Error::write(&path, e))?;
        }
    }
    drop(ticker);
    Ok(GeneratedCode { shared_object, required_features, cpu, triple, ptx, gpu_kernels })
}

/// One CPU variant's part of the header: its target, its kernels and every
/// device's plans with their arenas laid out.
fn cpu_variant(config: &CompileConfig, plan: &ModelPlan, scheduled: &Scheduled, code: &GeneratedCode) -> maxc_format::CpuVariant {
    use crate::schedule::{memory::plan_arena, Arg, Schedule};
    use maxc_format as mef;
    let to_plan = |s: &Schedule| -> mef::Plan {
        let (offsets, arena_bytes) = plan_arena(&s.buffers);
        let arg = |a: &Arg| a.map_arena(|b| offsets[b as usize]);
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
                .map(|c| mef::CollectiveStep { before_launch: c.before_launch as u32, op: c.op.clone(), input: arena(c.input), output: arena(c.output), rows: c.rows })
                .collect(),
            logits: arena(s.logits),
        }
    };
    let mesh = &plan.mesh;
    let devices = mesh.len();
    let kv_layout = mef::KvCacheLayout { layers: scheduled.kv.layers, row_elems: scheduled.kv.row_elems, head_dim: scheduled.kv.head_dim, encoding: plan.kv_encoding };
    let sub_models: Vec<mef::SubModel> = scheduled
        .schedules
        .iter()
        .enumerate()
        .map(|(d, (prefill, decode, last, batch))| mef::SubModel {
            name: if devices > 1 { format!("shard{d}") } else { "model".into() },
            device: format!("{}:{}", mesh.kind.name(), mesh.ordinals[d]),
            prefill: to_plan(prefill),
            decode: to_plan(decode),
            prefill_last: last.as_ref().map(to_plan),
            batch: batch.as_ref().map(|(mixed, decode, single)| mef::BatchPlans { mixed: to_plan(mixed), decode: to_plan(decode), single: to_plan(single) }),
            encode_batch: scheduled.encode_batch[d].as_ref().map(|(s, e)| mef::EncodeBatch { max_rows: e.max_rows, max_sequences: e.max_sequences, plan: to_plan(s) }),
            weight_bytes: 0,
            kv_bytes_per_token: kv_layout.bytes_per_token(),
        })
        .collect();
    let backend = config.backend.name().to_string();
    let spec = if code.shared_object.is_some() { config.cpu_spec.clone() } else { String::new() };
    mef::CpuVariant {
        target: mef::TargetInfo { triple: code.triple.clone(), cpu: code.cpu.clone(), required_features: code.required_features.clone(), backend: backend.clone(), spec },
        kernels: scheduled
            .kernels
            .kernels
            .iter()
            .zip(&code.gpu_kernels)
            .map(|(k, gpu)| mef::KernelEntry {
                symbol: k.name.clone(),
                family: k.family.clone(),
                num_params: k.params.len() as u32,
                backend: backend.clone(),
                gpu_threads_per_task: maxc_kernels::warp::threads_per_task(gpu),
                gpu_task_split: maxc_kernels::warp::task_split(&k.tasks, &gpu.tasks).expect("GPU forms are checked when recorded"),
            })
            .collect(),
        sub_models,
    }
}

/// The artifact's header: the plans of every device with their arenas laid
/// out, the kernels, provenance, target, mesh, KV cache and generation defaults
/// (weights and sections are filled in by the writer).
fn build_header(fe: &Frontend, config: &CompileConfig, plan: &ModelPlan, scheduled: &Scheduled, code: &GeneratedCode, options: &CompileOptions<'_>) -> Result<maxc_format::Header> {
    use maxc_format as mef;
    let first = cpu_variant(config, plan, scheduled, code);
    let kv_layout = mef::KvCacheLayout { layers: scheduled.kv.layers, row_elems: scheduled.kv.row_elems, head_dim: scheduled.kv.head_dim, encoding: plan.kv_encoding };
    // One code path with the compile cache's key (`cache.rs`), which computes
    // it before compiling: the build id it predicts is the one recorded here.
    let provenance = crate::provenance::provenance(&fe.manifest.text, &config.target_spec, &options.flags, &fe.model.input_files)?;
    let cfg = &fe.model.config;
    let m = &fe.manifest.manifest;
    let g = &m.generation;
    let d = &fe.model.generation;
    Ok(mef::Header {
        model: mef::ModelInfo {
            name: m.model.name.clone().unwrap_or_else(|| fe.model.name.clone()),
            architecture: cfg.architecture.hf_name().into(),
            vocab_size: cfg.vocab_size as u64,
            num_layers: cfg.num_layers as u64,
            embedding_width: cfg.encoder.map(|_| cfg.hidden_size as u64),
            experts: scheduled.experts.clone(),
        },
        provenance,
        target: first.target,
        sections: vec![],
        kernels: first.kernels,
        weights: vec![],
        mesh: plan.mesh.clone(),
        sub_models: first.sub_models,
        kv_cache: kv_layout,
        tokenizer: mef::TokenizerInfo { bos_token_id: cfg.bos_token_id, eos_token_ids: cfg.eos_token_ids.clone() },
        generation: {
            let mut merged = g.or(d);
            merged.repetition_penalty = merged.repetition_penalty.filter(|&r| r != 1.0);
            merged
        },
        max_length: scheduled.max_length,
        gpu_archs: config.targets.gpus.iter().map(|g| g.arch.clone()).collect(),
        batch: scheduled.batch,
        cpu_variants: Vec::new(),
    })
}

/// Every problem that would stop `compile`, found without generating code:
/// the same configuration checks (`CompileConfig::resolve` and `plan_for`),
/// every missing, misshapen or unused weight, and the graph's scheduling.
pub fn check(manifest: &LoadedManifest) -> Vec<crate::Error> {
    let mut problems = Vec::new();
    let config = CompileConfig::resolve(manifest).map_err(|p| problems.extend(p)).ok();
    let m = &manifest.manifest;
    let model = match import(&m.model.path, m.model.architecture.as_deref()) {
        Ok(model) => model,
        Err(e) => {
            problems.push(e);
            return problems;
        }
    };
    if let Err(e) = check_runtime_inputs(&model) {
        problems.push(e);
    }
    let plan = config.as_ref().and_then(|c| c.plan_for(manifest, &model).map_err(|p| problems.extend(p)).ok());
    let weight_problems = crate::builders::check_weights(&model);
    if !weight_problems.is_empty() {
        problems.extend(weight_problems);
        return problems;
    }
    let (Some(config), Some(plan)) = (config, plan) else { return problems };
    let pipeline = PipelineOptions { encoding: plan.encoding, embedding_encoding: config.embedding_encoding, stored: plan.stored.clone(), ..Default::default() };
    let result = device_graphs(&model, plan.mesh.len() as u32, plan.split_attention, &pipeline).and_then(|graphs| schedule_devices(&graphs, &model, &config, &plan).map(|_| ()));
    if let Err(e) = result {
        problems.push(e);
    }
    problems
}

/// `--dump-ir`: every kernel of `kernels` in the kernel IR's text form
/// (`maxc_kernels::ir_text`), one `NAME.kir` file each in `dir`.
fn dump_kernels(dir: &std::path::Path, kernels: &[maxc_kernels::Kernel]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| crate::Error::write(dir, e))?;
    for kernel in kernels {
        let path = dir.join(format!("{}.kir", kernel.name));
        std::fs::write(&path, maxc_kernels::ir_text::print(kernel)).map_err(|e| crate::Error::write(&path, e))?;
    }
    Ok(())
}

/// "`plan`: N launches, P per layer + R" and a histogram by kernel family, for `--dump-ir`.
fn launch_summary(plan: &str, s: &crate::schedule::Schedule, kernels: &crate::schedule::KernelSet) -> String {
    let family = |i: usize| kernels.kernels[s.launches[i].kernel as usize].family.as_str();
    let attention: Vec<usize> = (0..s.launches.len()).filter(|&i| family(i) == "attention").collect();
    let per_layer = attention.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    // Layers differ in launches where some are dense and some routed (Qwen3-MoE's `mlp_only_layers`).
    let rest = s.launches.len().saturating_sub(per_layer * attention.len());
    let mut families = std::collections::BTreeMap::new();
    for i in 0..s.launches.len() {
        *families.entry(family(i)).or_insert(0) += 1;
    }
    let hist: Vec<String> = families.iter().map(|(f, n)| format!("{f} {n}")).collect();
    format!("{plan}: {} launches, {per_layer} per layer + {rest} ({})\n", s.launches.len(), hist.join(", "))
}
