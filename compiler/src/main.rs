//! The `maxc` command line: `maxc compile` and `maxc eval` (the reference interpreter).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};

use maxc::driver::{frontend, CompileOptions};
use maxc::interp::{greedy, run_tokens, Interpreter};
use maxc::manifest::{CompileSection, FlagSetting, LoadedManifest};
use maxc::passes::PipelineOptions;
use maxrun_runtime::usage::usage;

#[derive(Parser)]
#[command(name = "maxc", version, about = "Ahead-of-time compiler from HF / GGUF models to MEF artifacts")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Compile a model (manifest or --model) through the graph pipeline.
    Compile(CompileArgs),
    /// Run the model with the reference interpreter (slow, exact: the oracle for debugging).
    Eval(EvalArgs),
    /// Pre-flight: report every problem that would stop a compile, without compiling.
    Check(CheckArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        shell: clap_complete::Shell,
    },
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    model: ModelArgs,
    // The `[compile]` keys as flags, over the manifest and its
    // `--model-override`s; `maxc check` takes them as `maxc compile` does.
    #[command(flatten)]
    settings: CompileSection,
}

#[derive(Args)]
struct ModelArgs {
    /// A ModelManifest (TOML).
    manifest: Option<PathBuf>,
    /// An HF directory or .gguf file, instead of a manifest.
    #[arg(long, conflicts_with = "manifest")]
    model: Option<PathBuf>,
    /// Override a manifest field: component.key=value (e.g. transformer.max_length=512).
    #[arg(long = "model-override", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
}

#[derive(Args)]
struct CompileArgs {
    #[command(flatten)]
    model: ModelArgs,
    // The `[compile]` keys as flags, over the manifest and its
    // `--model-override`s; `maxc check` takes them as `maxc compile` does.
    #[command(flatten)]
    settings: CompileSection,
    /// Write the IR after every pass to DIR as NN-<pass>.mxir.
    #[arg(long, value_name = "DIR")]
    dump_ir: Option<PathBuf>,
    /// Stop after the named pass (no artifact is written).
    #[arg(long, value_name = "PASS")]
    stop_after: Option<String>,
    /// The artifact to write.
    #[arg(short = 'o', long, value_name = "OUT.mef")]
    output: Option<PathBuf>,
    /// Threads for weight conversion (default: all cores). The artifact does not depend on it.
    #[arg(short = 'j', long)]
    jobs: Option<usize>,
    /// Compile a second time with a different thread count and fail unless both artifacts are byte-identical.
    #[arg(long)]
    check_reproducible: bool,
    /// Write the optimized LLVM IR of the kernels to DIR/kernels.ll.
    #[arg(long, value_name = "DIR")]
    emit_llvm: Option<PathBuf>,
    /// Write each GPU architecture's PTX module to DIR/<arch>.ptx (with --target cuda:...).
    #[arg(long, value_name = "DIR")]
    emit_ptx: Option<PathBuf>,
    /// Print nothing but errors.
    #[arg(short, long)]
    quiet: bool,
    /// `text` (default) or `json`: one JSON object per phase (wall time, peak memory) and a summary.
    #[arg(long, value_name = "FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Print one JSON object on stdout when done: the summary (output, bytes,
    /// build id, targets, encodings, memory, wall time per phase) or, on
    /// failure, the error with its file, field and exit code (docs/ci.md).
    #[arg(long, conflicts_with = "log_format")]
    json: bool,
    /// Keep artifacts in DIR by build id: compiling the same inputs again
    /// copies (or hard-links) the cached artifact (default: $MAXC_CACHE_DIR).
    /// The artifact does not depend on it.
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Neither read nor write the compile cache, even with MAXC_CACHE_DIR set.
    #[arg(long, conflicts_with = "cache_dir")]
    no_cache: bool,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text to tokenize (with the special tokens the tokenizer adds, as maxrun) and run.
    #[arg(long, conflicts_with = "token_ids")]
    prompt: Option<String>,
    /// Tokenize --prompt without the special tokens the tokenizer would add.
    #[arg(long, alias = "no-special", requires = "prompt")]
    no_special_tokens: bool,
    /// Comma-separated token ids to run.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Greedy tokens to generate after the prompt.
    #[arg(short = 'n', long, default_value_t = 0)]
    max_new_tokens: usize,
    /// Write the prompt's [seq, vocab] float32 logits to FILE (.npy).
    #[arg(long, value_name = "FILE")]
    dump_logits: Option<PathBuf>,
}

fn main() -> ExitCode {
    maxrun_runtime::output::remove_temp_files_on_signals("maxc", "no artifact was written");
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return parse_error(e),
    };
    let json = matches!(&cli.command, Command::Compile(a) if a.json);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if json {
                println!("{}", maxc::summary::error(&e));
            }
            maxrun_runtime::usage::exit_code(&e)
        }
    }
}

/// A command line clap refuses: its message and exit 2, and for `maxc compile
/// --json` the JSON error object on stdout as well.
fn parse_error(e: clap::Error) -> ExitCode {
    let mut args = std::env::args().skip(1);
    let compile_json = args.next().as_deref() == Some("compile") && args.any(|a| a == "--json");
    if !compile_json || !e.use_stderr() {
        e.exit();
    }
    let _ = e.print();
    let text = e.render().to_string();
    let message = text.lines().next().unwrap_or_default().trim_start_matches("error: ");
    println!("{}", maxc::summary::error(&usage(message)));
    ExitCode::from(2)
}

/// The manifest file, or the default manifest for `--model PATH`, with the
/// overrides and then `flags` (`[compile]` keys set on the command line) over it.
fn load_model(model: &ModelArgs, flags: &[FlagSetting]) -> anyhow::Result<LoadedManifest> {
    Ok(match (&model.manifest, &model.model) {
        (Some(m), _) => LoadedManifest::from_file_with_flags(m, &model.overrides, flags)?,
        (None, Some(p)) => LoadedManifest::from_model_path_with_flags(p, &model.overrides, flags)?,
        (None, None) => return Err(usage("MANIFEST: give a manifest file or --model PATH")),
    })
}

/// A flag that names a folder to write into: a path that exists must be one
/// (never a file, least of all an input, which creating the folder would fail on).
fn check_dump_dir(flag: &str, dir: Option<&Path>) -> anyhow::Result<()> {
    match dir {
        Some(d) if d.exists() && !d.is_dir() => {
            bail!("{flag} {}: is a file; {flag} takes a folder to write into (created if missing)", d.display())
        }
        _ => Ok(()),
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Compile(args) => compile(args),
        Command::Eval(args) => eval(args),
        Command::Check(args) => check(args),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "maxc", &mut std::io::stdout());
            Ok(())
        }
    }
}

fn options<'a>(dump: Option<&'a Path>, stop: Option<&'a str>) -> anyhow::Result<PipelineOptions<'a>> {
    if let Some(name) = stop {
        let names = maxc::passes::pass_names();
        if !names.contains(&name) {
            bail!("--stop-after: unknown pass `{name}`; passes: {}", names.join(", "));
        }
    }
    Ok(PipelineOptions { verify_each: true, dump_dir: dump, stop_after: stop, ..Default::default() })
}

fn compile(args: CompileArgs) -> anyhow::Result<()> {
    let flags = args.settings.flag_settings();
    let manifest = load_model(&args.model, &flags)?;
    let opts = options(args.dump_ir.as_deref(), args.stop_after.as_deref())?;
    check_dump_dir("--dump-ir", args.dump_ir.as_deref())?;
    check_dump_dir("--emit-llvm", args.emit_llvm.as_deref())?;
    check_dump_dir("--emit-ptx", args.emit_ptx.as_deref())?;
    let Some(output) = args.output.filter(|_| args.stop_after.is_none()) else {
        if args.stop_after.is_none() {
            return Err(usage("give -o OUT.mef (or --stop-after PASS to only run the graph pipeline)"));
        }
        let graphs = maxc::driver::frontend_graphs(&manifest, &opts)?;
        for (i, g) in graphs.iter().enumerate() {
            let device = if graphs.len() > 1 { format!(" on device {i}") } else { String::new() };
            eprintln!("graph `{}` after `{}`{device}: {} nodes", g.name, args.stop_after.as_deref().unwrap_or_default(), g.nodes.len());
        }
        return Ok(());
    };
    let (jobs, warning) = maxrun_runtime::pool::thread_count("--jobs", args.jobs).map_err(|e| anyhow::anyhow!(e))?;
    if let Some(w) = warning {
        eprintln!("maxc: warning: {w}");
    }
    check_output("-o", &output, &manifest)?;
    let start = std::time::Instant::now();
    let flags = provenance_flags(std::env::args().skip(1));
    let text = !args.quiet && !args.json && args.log_format == "text";
    // The cache: its key is the build id, known before compiling. A compile
    // that writes debugging outputs builds (only a build gives them) and stores.
    let cache_dir = args.cache_dir.clone().or_else(|| std::env::var_os("MAXC_CACHE_DIR").filter(|d| !d.is_empty()).map(PathBuf::from));
    let read = args.dump_ir.is_none() && args.emit_llvm.is_none() && args.emit_ptx.is_none();
    let mut cache = match cache_dir.filter(|_| !args.no_cache) {
        Some(dir) => Some(maxc::cache::CacheUse::begin(dir, &manifest, &flags, &output, read)?),
        None => None,
    };
    for w in cache.iter().flat_map(|c| &c.warnings) {
        eprintln!("maxc: warning: {w}");
    }
    let compile_options = CompileOptions { flags, pipeline: opts, emit_llvm: args.emit_llvm.clone(), emit_ptx: args.emit_ptx.clone(), progress: text };
    let mut report = match cache.as_ref().filter(|c| c.hit()) {
        Some(_) => cached_report(&output)?,
        None => with_threads(jobs, || maxc::driver::compile(manifest.clone(), &output, &compile_options))??,
    };
    if let Some(c) = cache.as_mut().filter(|c| !c.hit()) {
        if let Some(w) = c.store(&output) {
            eprintln!("maxc: warning: {w}");
        }
    }
    if let Some(c) = &cache {
        let (before, after) = c.phases.split_at(1);
        report.phases = [before, &report.phases, after].concat();
    }
    let cache_json = cache.as_ref().map(maxc::cache::CacheUse::to_json);
    if args.json {
        // Printed last, after --check-reproducible: one object, or the error.
    } else if args.log_format == "json" {
        for p in &report.phases {
            println!("{}", serde_json::json!({"phase": p.name, "wall_s": p.wall_s, "peak_rss_bytes": p.peak_rss_bytes, "peak_anon_bytes": p.peak_anon_bytes}));
        }
        println!(
            "{}",
            serde_json::json!({
                "artifact": output.display().to_string(), "bytes": report.artifact_bytes,
                "wall_s": start.elapsed().as_secs_f64(), "kernels": report.kernels,
                "prefill_launches": report.prefill_launches, "decode_launches": report.decode_launches,
                "cache": cache_json,
            })
        );
    } else if let Some(c) = cache.as_ref().filter(|c| c.hit() && !args.quiet) {
        eprintln!(
            "wrote {} ({:.1} MiB) in {:.2}s from the cache: {} ({})",
            output.display(),
            report.artifact_bytes as f64 / (1 << 20) as f64,
            start.elapsed().as_secs_f64(),
            c.entry.display(),
            c.transfer.map_or("", maxc::cache::Transfer::name)
        );
    } else if !args.quiet {
        eprintln!(
            "wrote {} ({:.1} MiB) in {:.1}s: {} kernels, {} prefill / {} decode launches",
            output.display(),
            report.artifact_bytes as f64 / (1 << 20) as f64,
            start.elapsed().as_secs_f64(),
            report.kernels,
            report.prefill_launches,
            report.decode_launches
        );
        for note in &report.notes {
            eprintln!("note: {note}");
        }
        // Peak RSS counts the checkpoint's mapped pages; peak anon is what
        // the compile itself holds (the memory a machine needs beyond the page cache).
        eprintln!("{:<24} {:>8} {:>14} {:>15}", "phase", "wall s", "peak RSS MiB", "peak anon MiB");
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        for p in &report.phases {
            eprintln!("{:<24} {:>8.2} {:>14.1} {:>15.1}", p.name, p.wall_s, mib(p.peak_rss_bytes), mib(p.peak_anon_bytes));
        }
        if let Some(c) = cache.as_ref().filter(|c| c.transfer.is_some()) {
            eprintln!("cached as {}", c.entry.display());
        }
    }
    if args.check_reproducible {
        let again = output.with_file_name(format!(
            ".{}.repro-{}",
            output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            std::process::id()
        ));
        let other_jobs = if jobs == 1 { 2 } else { 1 };
        let result = with_threads(other_jobs, || maxc::driver::compile(manifest, &again, &compile_options)).and_then(|_| compare_artifacts(&output, &again));
        let _ = std::fs::remove_file(&again);
        result?;
        if !args.json {
            eprintln!("reproducible: a second build with {other_jobs} thread(s) is byte-identical");
        }
    }
    if args.json {
        let mut summary = maxc::summary::success(&output, start.elapsed().as_secs_f64(), &report.phases, &report.notes, cache_json.unwrap_or_default())?;
        summary["reproducible"] = serde_json::json!(args.check_reproducible.then_some(true));
        println!("{summary}");
    }
    Ok(())
}

/// The report of an artifact the cache put at `output`: its numbers read back
/// from its header (no phases of a build and no notes: the build that made it
/// showed them).
fn cached_report(output: &Path) -> anyhow::Result<maxc::driver::CompileReport> {
    let artifact = maxrun_runtime::artifact::Artifact::open(output)?;
    let m = artifact.header.main();
    Ok(maxc::driver::CompileReport {
        artifact_bytes: artifact.file_len(),
        kernels: artifact.header.kernels.len(),
        prefill_launches: m.prefill.launches.len(),
        decode_launches: m.decode.launches.len(),
        prefill_arena_bytes: m.prefill.arena_bytes,
        decode_arena_bytes: m.decode.arena_bytes,
        phases: Vec::new(),
        notes: Vec::new(),
    })
}

/// Refuses an output path that would destroy something: an input of the
/// compile (the manifest, the GGUF, any file of the model's directory, after
/// symbolic links), or anything that is not a regular file or a new path
/// (a directory, a device such as /dev/null, a FIFO). Outputs are written to a
/// temporary file beside them and renamed at the end (`maxrun_runtime::output`).
fn check_output(flag: &str, output: &Path, manifest: &maxc::manifest::LoadedManifest) -> anyhow::Result<()> {
    let model = &manifest.manifest.model.path;
    let mut inputs: Vec<PathBuf> = manifest.source.iter().cloned().collect();
    if model.is_dir() {
        for entry in std::fs::read_dir(model).with_context(|| format!("reading {}", model.display()))? {
            inputs.push(entry?.path());
        }
    } else {
        inputs.push(model.clone());
    }
    maxrun_runtime::output::check_output(flag, output, &inputs).map_err(anyhow::Error::msg)
}

/// Runs `f` on a rayon pool of `threads` threads.
fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().context("starting the worker threads")?;
    Ok(pool.install(f))
}

/// Fails with the first differing offset (and its section) unless the files are identical.
fn compare_artifacts(a: &Path, b: &Path) -> anyhow::Result<()> {
    let (x, y) = (std::fs::read(a)?, std::fs::read(b)?);
    if x == y {
        return Ok(());
    }
    let at = x.iter().zip(&y).position(|(p, q)| p != q).unwrap_or(x.len().min(y.len())) as u64;
    let header = maxrun_runtime::artifact::Artifact::open(a)?.header;
    let section = header
        .sections
        .iter()
        .find(|s| (s.offset..s.offset + s.len).contains(&at))
        .map_or("header".to_string(), |s| format!("{:?} section", s.kind));
    bail!("not reproducible: a second build differs first at byte {at} (in the {section}); sizes {} and {}", x.len(), y.len())
}

fn check(args: CheckArgs) -> anyhow::Result<()> {
    let manifest = load_model(&args.model, &args.settings.flag_settings())?;
    let problems = maxc::driver::check(&manifest);
    if problems.is_empty() {
        println!("ok: {} can be compiled", manifest.manifest.model.path.display());
        return Ok(());
    }
    for p in &problems {
        println!("problem: {p}");
    }
    bail!("{} problem(s) found; nothing was compiled", problems.len())
}

fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let manifest = load_model(&args.model, &[])?;
    if let Some(path) = &args.dump_logits {
        check_output("--dump-logits", path, &manifest)?;
    }
    let fe = frontend(manifest, &options(None, None)?)?;
    let tokenizer: tokenizers::Tokenizer =
        fe.model.tokenizer_json.parse().map_err(|e| anyhow::anyhow!("loading the tokenizer: {e}"))?;
    let ids: Vec<u32> = match (&args.prompt, &args.token_ids) {
        (Some(p), _) => tokenizer.encode(p.as_str(), !args.no_special_tokens).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?.get_ids().to_vec(),
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt TEXT or --token-ids 1,2,3"),
    };
    if ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    let vocab = fe.model.config.vocab_size;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("--token-ids: token id {bad} is outside the vocabulary of {vocab} tokens");
    }
    let mut interp = Interpreter::new(&fe.graph, &fe.model.weights);
    if let Some(path) = &args.dump_logits {
        let logits = run_tokens(&mut interp, &ids, 0)?;
        maxrun_runtime::npy::write_f32(path, &logits.shape, logits.as_f32()).with_context(|| format!("writing {}", path.display()))?;
        interp.reset();
    }
    if args.max_new_tokens > 0 {
        let out = greedy(&mut interp, &ids, args.max_new_tokens)?;
        let text = tokenizer.decode(&out, false).map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
        println!("{text}");
    }
    Ok(())
}

/// The command line as recorded in the artifact: every flag that can change what
/// is built. The output path, thread count and debugging outputs cannot, and are
/// left out so that the same inputs give the same bytes wherever and however built.
fn provenance_flags(args: impl Iterator<Item = String>) -> Vec<String> {
    const WITH_VALUE: &[&str] = &["-o", "--output", "-j", "--jobs", "--dump-ir", "--emit-llvm", "--emit-ptx", "--log-format", "--cache-dir"];
    const ALONE: &[&str] = &["--check-reproducible", "--quiet", "-q", "--json", "--no-cache"];
    let mut out = Vec::new();
    let mut skip_next = false;
    for a in args {
        if skip_next {
            skip_next = false;
            continue;
        }
        if WITH_VALUE.contains(&a.as_str()) {
            skip_next = true;
        } else if ALONE.contains(&a.as_str()) || WITH_VALUE.iter().any(|f| a.starts_with(&format!("{f}=")) || (f.len() == 2 && a.starts_with(f) && a.len() > 2)) {
        } else {
            out.push(a);
        }
    }
    out
}
