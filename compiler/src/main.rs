//! The `maxc` command line: `maxc compile` and `maxc eval` (the reference interpreter).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};

use maxc::driver::{frontend, load_manifest, CompileOptions};
use maxc::interp::{greedy, run_tokens, Interpreter};
use maxc::passes::{by_name, PipelineOptions};

#[derive(Parser)]
#[command(name = "maxc", version, about = "Ahead-of-time compiler from HF / GGUF models to MEF artifacts")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile a model (manifest or --model) through the graph pipeline.
    Compile(CompileArgs),
    /// Run the model with the reference interpreter (slow, exact: the oracle for debugging).
    Eval(EvalArgs),
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
    /// Write the IR after every pass to DIR as NN-<pass>.mxir.
    #[arg(long, value_name = "DIR")]
    dump_ir: Option<PathBuf>,
    /// Stop after the named pass (no artifact is written).
    #[arg(long, value_name = "PASS")]
    stop_after: Option<String>,
    /// The artifact to write.
    #[arg(short = 'o', long, value_name = "OUT.mef")]
    output: Option<PathBuf>,
    /// Code target: `cpu` (this machine), `cpu:x86-64-v3`, `cpu:x86-64-v4`, `cpu:NAME+feature,...`.
    #[arg(long)]
    target: Option<String>,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text to tokenize and run.
    #[arg(long, conflicts_with = "token_ids")]
    prompt: Option<String>,
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
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Compile(args) => compile(args),
        Command::Eval(args) => eval(args),
    }
}

fn options<'a>(dump: Option<&'a Path>, stop: Option<&'a str>) -> anyhow::Result<PipelineOptions<'a>> {
    if let Some(name) = stop {
        if by_name(name).is_none() {
            let names: Vec<&str> = maxc::passes::pipeline().iter().map(|p| p.name()).collect();
            bail!("--stop-after: unknown pass `{name}`; passes: {}", names.join(", "));
        }
    }
    Ok(PipelineOptions { verify_each: true, dump_dir: dump, stop_after: stop })
}

fn compile(args: CompileArgs) -> anyhow::Result<()> {
    let manifest = load_manifest(args.model.manifest.as_deref(), args.model.model.as_deref(), &args.model.overrides)?;
    let opts = options(args.dump_ir.as_deref(), args.stop_after.as_deref())?;
    let Some(output) = args.output.filter(|_| args.stop_after.is_none()) else {
        if args.stop_after.is_none() {
            bail!("give -o OUT.mef (or --stop-after PASS to only run the graph pipeline)");
        }
        let fe = frontend(manifest, &opts)?;
        eprintln!("graph `{}` after `{}`: {} nodes", fe.graph.name, args.stop_after.unwrap_or_default(), fe.graph.nodes.len());
        return Ok(());
    };
    let start = std::time::Instant::now();
    let flags = provenance_flags(std::env::args().skip(1));
    let compile_options = CompileOptions { target: args.target, flags, pipeline: opts };
    let report = maxc::driver::compile(manifest, &output, &compile_options)?;
    eprintln!(
        "wrote {} ({:.1} MiB) in {:.1}s: {} kernels, {} prefill / {} decode launches",
        output.display(),
        report.artifact_bytes as f64 / (1 << 20) as f64,
        start.elapsed().as_secs_f64(),
        report.kernels,
        report.prefill_launches,
        report.decode_launches
    );
    Ok(())
}

fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let manifest = load_manifest(args.model.manifest.as_deref(), args.model.model.as_deref(), &args.model.overrides)?;
    let fe = frontend(manifest, &options(None, None)?)?;
    let tokenizer: tokenizers::Tokenizer =
        fe.model.tokenizer_json.parse().map_err(|e| anyhow::anyhow!("loading the tokenizer: {e}"))?;
    let ids: Vec<u32> = match (&args.prompt, &args.token_ids) {
        (Some(p), _) => tokenizer.encode(p.as_str(), false).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?.get_ids().to_vec(),
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt TEXT or --token-ids 1,2,3"),
    };
    if ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    let mut interp = Interpreter::new(&fe.graph, &fe.model.weights);
    if let Some(path) = &args.dump_logits {
        let logits = run_tokens(&mut interp, &ids, 0)?;
        maxrun::npy::write_f32(path, &logits.shape, logits.as_f32()).with_context(|| format!("writing {}", path.display()))?;
        interp.reset();
    }
    if args.max_new_tokens > 0 {
        let out = greedy(&mut interp, &ids, args.max_new_tokens)?;
        let text = tokenizer.decode(&out, false).map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
        println!("{text}");
    }
    Ok(())
}

/// The command line as recorded in the artifact: everything but the output path,
/// which names where the artifact goes, not what it is (same inputs, same bytes).
fn provenance_flags(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip_next = false;
    for a in args {
        if skip_next {
            skip_next = false;
        } else if a == "-o" || a == "--output" {
            skip_next = true;
        } else if !(a.starts_with("--output=") || (a.starts_with("-o") && a.len() > 2)) {
            out.push(a);
        }
    }
    out
}
