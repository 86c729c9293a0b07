//! The `maxrun` command line: load an artifact and generate text (or dump logits).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{anyhow, Context};
use clap::{Args, Parser, Subcommand};

use maxrun_runtime::artifact::Artifact;
use maxrun_engine::embed::{Embedder, EncoderFacts};
use maxrun_engine::{Engine, Event, GenerationParams, ModelFacts, Request};
use maxrun_runtime::executor::{EncodeExecutor, OnePerStep};
use maxrun_runtime::sampler::SamplingParams;
use maxrun_runtime::runner::{Device, Runner};
use maxrun_runtime::usage::usage;

#[derive(Parser)]
#[command(
    name = "maxrun",
    version,
    about = "Run a maxc artifact (.mef): generate text or dump logits",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Show what an artifact records: provenance, target, plans, kernels, weights, memory, checksums.
    Inspect(InspectArgs),
    /// Measure prefill (pp) and decode (tg) tokens/s, like llama-bench.
    Bench(BenchArgs),
    /// Serve the artifact over HTTP with an OpenAI-compatible API (docs/serving.md).
    Serve(ServeArgs),
    /// Perplexity over a text, and the KL divergence against a base, as llama-perplexity computes them (docs/user-guide.md).
    Perplexity(PerplexityArgs),
}

#[derive(Args)]
struct PerplexityArgs {
    artifact: PathBuf,
    /// The text to score (UTF-8), tokenized with the artifact's tokenizer (special tokens added as it adds them).
    #[arg(short = 'f', long = "file", value_name = "TEXT")]
    file: Option<PathBuf>,
    /// Token ids instead of a text: decimal ids separated by spaces, newlines or
    /// commas, taken as the tokenized text (chunked and given a BOS the same way).
    #[arg(long, value_name = "FILE", conflicts_with = "file")]
    token_ids_file: Option<PathBuf>,
    /// Tokens per chunk (default: 512 as llama-perplexity, or the artifact's maximum context if smaller; with --kl-divergence: the base's).
    #[arg(short = 'c', long, value_name = "N")]
    ctx: Option<usize>,
    /// Score only the first K chunks (default: every whole chunk of the text).
    #[arg(long, value_name = "K")]
    chunks: Option<usize>,
    /// Worker threads (default: the CPUs this process may use, from its affinity mask and CPU quota).
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON object instead of the text report.
    #[arg(long)]
    json: bool,
    /// Save this artifact's scored log-probabilities to FILE as the base of later
    /// comparisons; with --kl-divergence, read FILE and compare against it.
    #[arg(long, value_name = "FILE")]
    kl_divergence_base: Option<PathBuf>,
    /// Compare against the base saved in --kl-divergence-base FILE: KL divergence, top-1 agreement, both PPLs.
    #[arg(long, requires = "kl_divergence_base")]
    kl_divergence: bool,
    /// Compare against another artifact run on the same chunks in this process (no base file).
    #[arg(long, value_name = "BASE.mef", conflicts_with = "kl_divergence_base")]
    base: Option<PathBuf>,
    /// Where to run, as for a run: auto, cpu, gpu, gpu:N.
    #[arg(long, default_value = "auto")]
    device: Device,
    /// Skip the weights checksum, which is otherwise checked before the run.
    #[arg(long)]
    no_verify: bool,
}

#[derive(Args)]
struct ServeArgs {
    artifact: PathBuf,
    /// The address to listen on (loopback by default; 0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port (0: any free one; the address chosen is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on the API endpoints (401 otherwise).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// The model name clients send and /v1/models lists (default: the artifact's model name).
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,
    /// Requests that may wait for room in the engine; more get 503 with Retry-After.
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_queue: usize,
    /// Seconds requests in flight get to finish after SIGTERM / SIGINT before they are cancelled.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Worker threads of the engine (default: the CPUs this process may use, from its affinity mask and CPU quota).
    #[arg(long)]
    threads: Option<usize>,
    /// The KV pool's size in bytes (default: every sequence at the full context,
    /// at most a quarter of the available memory).
    #[arg(long, value_name = "BYTES")]
    kv_cache_memory: Option<u64>,
    /// Where the batched engine runs: auto (the GPU when the artifact has GPU
    /// code and a CUDA driver and device are present, else the CPU code; a
    /// sharded artifact on its CPU devices), cpu, gpu, gpu:N.
    #[arg(long, default_value = "auto")]
    device: Device,
    /// Skip the weights checksum, which is otherwise checked before serving.
    #[arg(long)]
    no_verify: bool,
    /// The weights checksum is checked by default (kept for old scripts).
    #[arg(long, hide = true, conflicts_with = "no_verify")]
    verify: bool,
    /// How the model writes tool calls: hermes, llama3, mistral, harmony
    /// (gpt-oss) (default: from the chat template's markers; hermes for
    /// templates without tool support).
    #[arg(long, value_name = "FORMAT")]
    tool_parser: Option<String>,
    /// Split `<think>...</think>` (or a harmony reply's analysis channel) into
    /// `reasoning_content`: think, or none (default: think when the chat
    /// template mentions `<think>` or `<|channel|>`).
    #[arg(long, value_name = "PARSER")]
    reasoning_parser: Option<String>,
    /// Drop request fields the server does not know instead of answering 400
    /// (for clients that send their own extensions).
    #[arg(long)]
    allow_extra_request_fields: bool,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// Responses of /v1/responses kept in memory for `previous_response_id`
    /// and GET /v1/responses/{id}, least recently used out first (0 keeps none).
    #[cfg(feature = "serve")]
    #[arg(long, value_name = "N", default_value_t = maxrun_server::response_store::StoreLimits::default().entries)]
    response_store_entries: usize,
    /// The bytes those kept responses may take, at most (their JSON and conversation text).
    #[cfg(feature = "serve")]
    #[arg(long, value_name = "BYTES", default_value_t = maxrun_server::response_store::StoreLimits::default().bytes)]
    response_store_memory: usize,
}

#[derive(Args)]
struct BenchArgs {
    artifact: PathBuf,
    /// Prompt tokens of the prefill test (0 skips it).
    #[arg(short = 'p', long, default_value_t = 512)]
    prompt_tokens: u64,
    /// Tokens of the decode test (0 skips it).
    #[arg(short = 'n', long, default_value_t = 128)]
    generated_tokens: u64,
    /// Worker threads (default: the CPUs this process may use, from its affinity mask and CPU quota).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: u32,
    /// Tokens already in the KV cache when each test starts (an untimed prefill),
    /// as llama-bench's -d: decode and prefill speed deep into a context.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also print a table of kernels ranked by total time.
    #[arg(long)]
    profile: bool,
    #[command(flatten)]
    memory: WeightsMemory,
    /// Skip the weights checksum, which is otherwise checked before the runs (as
    /// a run and `serve` check it: numbers from damaged weights mean nothing).
    #[arg(long)]
    no_verify: bool,
    /// Compare with another artifact: the two run turn about in one process, so
    /// that both see the same machine (a shared VM's bandwidth moves by tens of
    /// percent between minutes); prints both and their ratios.
    #[arg(long, value_name = "OTHER.mef")]
    compare: Option<PathBuf>,
    /// Run N sequences together through the batched engine (prompts of -p
    /// tokens, then -n tokens each) and report the aggregate decode rate, the
    /// time per step and the time to first token.
    #[arg(long, value_name = "N")]
    concurrency: Option<usize>,
    /// With --concurrency: every prompt starts with the same N tokens (the
    /// prefix-cache case).
    #[arg(long, value_name = "N", default_value_t = 0, requires = "concurrency")]
    shared_prefix: u64,
    /// With --concurrency: the KV pool's size in bytes (default: every sequence
    /// at the full context, at most a quarter of the available memory).
    #[arg(long, value_name = "BYTES", requires = "concurrency")]
    kv_cache_memory: Option<u64>,
    /// Where to run, as for a run: auto (the GPU when the artifact has GPU code
    /// and a CUDA driver and device are present), cpu, gpu, gpu:N. On a GPU the
    /// roofline divides by a device-to-device copy's bandwidth.
    #[arg(long, default_value = "auto")]
    device: Device,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// With --speculative (or --draft): the prompts to run, a JSON-lines file of
    /// `{"prompt": ..., "kind": ...}` (such as ../shared/speculation/prompts.jsonl),
    /// plain and speculative decoding in turns; -n new tokens each, greedy.
    #[arg(long, value_name = "FILE")]
    prompts: Option<PathBuf>,
    /// With --prompts: send each prompt as it is, without the chat template.
    #[arg(long, requires = "prompts")]
    no_chat_template: bool,
}

/// Speculative decoding (run, chat, bench, serve).
#[derive(Args, Clone)]
struct SpeculativeArgs {
    /// Speculative decoding: `ngram` drafts the tokens that followed the
    /// longest earlier occurrence of the sequence's last tokens (prompt lookup);
    /// `draft` (with --draft) has a second artifact draft them. Drafts are
    /// verified in one batch step; the output is what plain decoding gives,
    /// token for token (docs/serving.md, Speculative decoding).
    #[arg(long, value_name = "METHOD")]
    speculative: Option<String>,
    /// The draft model for --speculative draft (implied): an artifact with the
    /// target's tokenizer, such as a q4_k copy of the same model.
    #[arg(long, value_name = "DRAFT.mef")]
    draft: Option<PathBuf>,
    /// With --speculative: the most tokens drafted per step and sequence
    /// (1-15; by default 4 by prompt lookup, 8 by a draft model, whose drafts
    /// stand more often); how many of them are drafted follows their acceptance.
    #[arg(long, value_name = "K")]
    draft_tokens: Option<usize>,
    /// With --speculative ngram: the n-gram lengths matched, MIN..MAX.
    #[arg(long, value_name = "MIN..MAX", default_value = "2..5")]
    ngram: String,
}

impl SpeculativeArgs {
    /// The engine's settings, or `None` without --speculative.
    fn config(&self) -> anyhow::Result<Option<maxrun_engine::speculate::SpeculationConfig>> {
        let method = match (self.speculative.as_deref(), &self.draft) {
            (None, None) => return Ok(None),
            (None | Some("draft"), Some(_)) => "draft",
            (Some("draft"), None) => return Err(anyhow!("--speculative draft needs --draft DRAFT.mef, the draft model")),
            (Some("ngram"), Some(_)) => return Err(anyhow!("--draft is the draft model of --speculative draft; prompt lookup (--speculative ngram) takes none")),
            (Some("ngram"), None) => "ngram",
            (Some(other), _) => return Err(anyhow!("--speculative `{other}`: the methods are: ngram, draft (with --draft DRAFT.mef)")),
        };
        let max_drafts = self.draft_tokens.unwrap_or(if method == "draft" { 8 } else { 4 });
        let bad = || anyhow!("--ngram `{}`: give MIN..MAX, two lengths such as 2..5", self.ngram);
        let (min, max) = self.ngram.split_once("..").ok_or_else(bad)?;
        let (min_n, max_n) = (min.trim().parse().map_err(|_| bad())?, max.trim().parse().map_err(|_| bad())?);
        let config = maxrun_engine::speculate::SpeculationConfig { max_drafts, min_n, max_n, ..Default::default() };
        config.check().map_err(|e| anyhow!(e))?;
        Ok(Some(config))
    }
}

/// Where a run reads the weights from (run and bench).
#[derive(Args)]
struct WeightsMemory {
    /// Read the artifact into private memory on transparent huge pages instead of
    /// running from the file mapping: decode 2-6% faster, at the cost of copying
    /// the file at start (about 0.1 s per 500 MB). Artifacts larger than half the
    /// available memory are mapped anyway.
    #[arg(long)]
    huge_pages: bool,
}

impl WeightsMemory {
    /// Opens an artifact to run: the file mapping, or with `--huge-pages` a
    /// private copy on huge pages (`on_gpu`: never, a GPU run uploads the weights).
    fn open(&self, path: &std::path::Path, on_gpu: bool) -> Result<Artifact, maxrun_runtime::artifact::ArtifactError> {
        if self.huge_pages && !on_gpu {
            Artifact::open_resident(path)
        } else {
            Artifact::open(path)
        }
    }
}

#[derive(Args)]
struct InspectArgs {
    artifact: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Also verify the weights checksum (reads the whole file).
    #[arg(long)]
    verify: bool,
}

#[derive(Args)]
struct RunArgs {
    /// The artifact produced by `maxc compile`.
    artifact: Option<PathBuf>,
    /// Skip the weights checksum. By default it is checked on a second thread
    /// while the tokenizer loads, and a damaged weights section is refused before
    /// anything runs.
    #[arg(long)]
    no_verify: bool,
    /// The weights checksum is checked by default (kept for old scripts).
    #[arg(long, hide = true, conflicts_with = "no_verify")]
    verify: bool,
    /// Say on stderr which CPU code runs (the variant a multi-ISA artifact
    /// picked for this machine) and on how many threads.
    #[arg(short, long)]
    verbose: bool,
    /// Text to continue. It is tokenized as `transformers`' `tokenizer(text)` and
    /// llama.cpp do: with the special tokens the tokenizer's post-processor adds
    /// (a BOS for Llama 3 and Gemma tokenizers, a GGUF's `add_bos_token`).
    #[arg(long, conflicts_with = "token_ids")]
    prompt: Option<String>,
    /// Tokenize --prompt without the special tokens the tokenizer would add.
    #[arg(long, alias = "no-special", requires = "prompt")]
    no_special_tokens: bool,
    /// Print the sentence embedding of TEXT as a JSON array (encoder artifacts).
    #[arg(long, conflicts_with_all = ["prompt", "token_ids", "dump_logits"])]
    embed: Option<String>,
    /// Print one embedding (JSON array) per line of FILE (encoder artifacts).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "token_ids", "dump_logits", "embed"])]
    embed_file: Option<PathBuf>,
    /// Interactive chat with the model's chat template; one user message per line of
    /// stdin, until EOF (Ctrl-D). Earlier turns stay in the KV cache.
    #[arg(long, conflicts_with_all = ["prompt", "token_ids", "dump_logits", "embed", "embed_file"])]
    chat: bool,
    /// A system message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Comma-separated token ids instead of a prompt.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Run one forward pass over the prompt and write its [seq, vocab] float32 logits (.npy); no sampling.
    #[arg(long, value_name = "FILE")]
    dump_logits: Option<PathBuf>,
    /// Maximum number of new tokens (default: the artifact's generation config, else 128).
    #[arg(short = 'n', long)]
    max_new_tokens: Option<u32>,
    /// Sampling temperature; 0 is greedy (default: the artifact's generation config).
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample only among the K most likely tokens; 0 keeps them all (default: the artifact's generation config, else 0).
    #[arg(long, value_name = "K")]
    top_k: Option<u32>,
    /// Sample only among the most likely tokens whose probabilities add up to P, in (0, 1]; 1 keeps them all (default: the artifact's generation config, else 1).
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one, in [0, 1]; 0 keeps them all (default: the artifact's generation config, else 0).
    #[arg(long, value_name = "P")]
    min_p: Option<f32>,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the generated text contains STRING (repeatable); STRING is not printed.
    #[arg(long = "stop", value_name = "STRING")]
    stops: Vec<String>,
    /// Divide (or, for negative logits, multiply) the logits of the last 64 tokens by P (> 1 discourages repeats).
    #[arg(long, value_name = "P")]
    repeat_penalty: Option<f32>,
    /// After the run, print kernels ranked by time for prefill and decode.
    #[arg(long)]
    profile: bool,
    /// Stop at the first kernel whose output holds a NaN or an infinity, and name it.
    #[arg(long)]
    check_nan: bool,
    /// Print the generated text once at the end instead of streaming it.
    #[arg(long)]
    no_stream: bool,
    /// Hold the output to this JSON schema (a file; structured output through
    /// llguidance, as the server's `response_format`).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["grammar", "regex"])]
    json_schema: Option<PathBuf>,
    /// Hold the output to this Lark grammar (a file; llguidance's dialect).
    #[arg(long, value_name = "FILE", conflicts_with = "regex")]
    grammar: Option<PathBuf>,
    /// Hold the output to this regular expression.
    #[arg(long, value_name = "REGEX")]
    regex: Option<String>,
    /// Never sample an end-of-sequence token (its logit is set to -inf, as llama.cpp's
    /// --ignore-eos and transformers' min_new_tokens do): always generate -n tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Worker threads (default: the CPUs this process may use, from its affinity mask and CPU quota).
    #[arg(long)]
    threads: Option<usize>,
    /// Where to run: auto (the GPU when the artifact has GPU code and a CUDA
    /// driver and device are present, else the CPU code), cpu, gpu, gpu:N.
    #[arg(long, default_value = "auto")]
    device: Device,
    #[command(flatten)]
    memory: WeightsMemory,
    #[command(flatten)]
    speculative: SpeculativeArgs,
}

/// The thread count for a `--threads` flag (default: the CPUs this process may
/// use), printing a warning when it is more than those.
fn threads(flag: Option<usize>) -> anyhow::Result<usize> {
    let (n, warning) = maxrun_runtime::pool::thread_count("--threads", flag).map_err(|e| anyhow!(e))?;
    if let Some(w) = warning {
        eprintln!("maxrun: warning: {w}");
    }
    Ok(n)
}

/// Opens a session on the requested device, printing why `auto` fell back to the
/// CPU, with `--check-nan` and `--profile` applied (CPU sessions).
fn open_runner<'a>(artifact: &'a Artifact, cli: &RunArgs) -> anyhow::Result<Runner<'a>> {
    let threads = threads(cli.threads)?;
    let (mut runner, note) = Runner::open(artifact, threads, cli.device)?;
    if let Some(note) = note {
        eprintln!("maxrun: {note}");
    }
    if cli.verbose {
        eprintln!("maxrun: {}; {}", artifact.cpu_variant_note(), runner.describe());
    }
    match runner.cpu() {
        Some(cpu) => {
            cpu.check_nan = cli.check_nan;
            if cli.profile {
                cpu.enable_profile();
            }
        }
        None if cli.check_nan || cli.profile => eprintln!("maxrun: --check-nan and --profile run on one CPU device; ignored on the GPU and on device meshes"),
        None => {}
    }
    Ok(runner)
}

/// Exit code for a prompt that does not fit (docs/user-guide.md, "Exit codes"):
/// apart from 1 (other errors) and clap's 2 (a usage error on the command line).
const EXIT_PROMPT_TOO_LONG: u8 = 3;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Inspect(args)) => inspect(args),
        Some(Command::Bench(args)) => bench(args),
        Some(Command::Serve(args)) => serve(args),
        Some(Command::Perplexity(args)) => perplexity(args),
        None => run(cli.run),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            maxrun_runtime::usage::exit_code(&e)
        }
    }
}

/// Checks a float flag: a finite number in `lo..=hi` (`hi` None: no upper bound).
fn check_range(name: &str, v: Option<f32>, lo: f32, hi: Option<f32>) -> anyhow::Result<()> {
    let Some(x) = v else { return Ok(()) };
    if !x.is_finite() {
        return Err(anyhow!("--{name} {x}: give a finite number"));
    }
    match hi {
        Some(hi) if !(lo..=hi).contains(&x) => Err(anyhow!("--{name} {x} must be between {lo} and {hi}")),
        None if x < lo => Err(anyhow!("--{name} {x} must be at least {lo}")),
        _ => Ok(()),
    }
}

/// Verifies the weights checksum, with a progress bar on a terminal for large files.
fn verify_weights(artifact: &Artifact) -> anyhow::Result<()> {
    let total: u64 = artifact.weight_sections().map(|k| artifact.section(k).len() as u64).sum();
    let bar = if std::io::stderr().is_terminal() && total > 64 << 20 {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(indicatif::ProgressStyle::with_template("verifying weights {bar:30} {bytes}/{total_bytes} {eta}").unwrap());
        Some(b)
    } else {
        None
    };
    artifact.verify_weights(&mut |done, _| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(())
}

/// Refuses a benchmark that needs more positions than `artifact` (at `path`) has.
fn fits_benchmark(path: &std::path::Path, artifact: &Artifact, needed: u64) -> anyhow::Result<()> {
    let max = artifact.header.max_length;
    if needed > max {
        return Err(anyhow!(
            "the benchmark needs {needed} positions but {} supports {max}; compile with --model-override transformer.max_length={needed}",
            path.display()
        ));
    }
    Ok(())
}

fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    if args.repetitions == 0 {
        return Err(anyhow!("--repetitions must be at least 1"));
    }
    let threads = threads(args.threads)?;
    if args.profile && args.compare.is_some() {
        return Err(anyhow!("--profile and --compare do not go together; profile each artifact on its own"));
    }
    let artifact = args.memory.open(&args.artifact, false)?;
    if !args.no_verify {
        artifact.verify_weights(&mut |_, _| {})?;
    }
    let h = &artifact.header;
    let needed = args.depth + args.prompt_tokens.max(args.generated_tokens);
    fits_benchmark(&args.artifact, &artifact, needed)?;
    if artifact.cpu_variants.len() > 1 {
        eprintln!("maxrun: {}", artifact.cpu_variant_note());
    }
    if let Some(config) = args.speculative.config()? {
        return bench_speculative(&args, &artifact, config, threads);
    }
    if args.prompts.is_some() {
        return Err(anyhow!("--prompts is the prompt file of bench --speculative METHOD (or --draft DRAFT.mef): give one of them"));
    }
    if let Some(n) = args.concurrency {
        return bench_concurrency(&args, &artifact, n, threads);
    }
    let cfg = maxrun::bench::BenchConfig { prompt_tokens: args.prompt_tokens, generated_tokens: args.generated_tokens, repetitions: args.repetitions, depth: args.depth };
    if let Some(other_path) = &args.compare {
        let other = args.memory.open(other_path, false)?;
        if !args.no_verify {
            other.verify_weights(&mut |_, _| {})?;
        }
        fits_benchmark(other_path, &other, needed)?;
        let (mut a, _) = open_bench_runner(&artifact, threads, args.device)?;
        let (mut b, _) = open_bench_runner(&other, threads, args.device)?;
        let names = [args.artifact.display().to_string(), other_path.display().to_string()];
        let vocab = h.model.vocab_size.min(other.header.model.vocab_size);
        let report = maxrun::bench::compare([&mut a, &mut b], cfg, names, vocab)?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", maxrun::bench::render_comparison(&report));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let (mut session, _) = open_bench_runner(&artifact, threads, args.device)?;
    if args.profile {
        let on = session.describe();
        let why = if on.starts_with("GPU") {
            anyhow!("--profile times the CPU code's kernels; this bench runs on the {on}: add --device cpu")
        } else {
            anyhow!("--profile runs on one CPU device; this artifact is split over {}", h.mesh.spec())
        };
        session.cpu().ok_or(why)?.enable_profile();
    }
    let weights = artifact.section(maxrun_runtime::format::SectionKind::Weights(0));
    let weights_memory = if artifact.is_resident() { "huge pages" } else { "file mapping" };
    // What a decode step reads: no untied input table, a mixture of experts'
    // chosen experts only (`inspect`'s `weight_bytes_per_token` too).
    let weight_bytes = h.decode_weight_bytes();
    let devices = h.sub_models.len() as u64;
    let report = maxrun::bench::run(
        &mut session,
        cfg,
        &h.model.name,
        weights,
        weight_bytes,
        (h.kv_cache.bytes_per_token() * devices, h.kv_cache.encoding.name()),
        h.model.vocab_size,
        weights_memory,
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", maxrun::bench::render(&report));
    }
    if args.profile {
        eprint!("{}", render_profile(&session.cpu().map(|s| s.profile()).unwrap_or_default()));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "serve")]
fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    if args.max_queue == 0 {
        return Err(anyhow!("--max-queue must be at least 1"));
    }
    let threads = threads(args.threads)?;
    if !(args.shutdown_timeout.is_finite() && args.shutdown_timeout >= 0.0) {
        return Err(anyhow!("--shutdown-timeout {} must be a number of seconds >= 0", args.shutdown_timeout));
    }
    if args.api_key.as_deref().is_some_and(str::is_empty) {
        return Err(anyhow!("--api-key needs a non-empty key"));
    }
    let artifact = Artifact::open(&args.artifact)?;
    if !args.no_verify {
        verify_weights(&artifact)?;
    }
    let tool_parser = args.tool_parser.as_deref().map(maxrun_engine::constrain::tools::ToolFormat::parse).transpose().map_err(|e| anyhow!("--tool-parser {e}"))?;
    let reasoning = match args.reasoning_parser.as_deref() {
        None => None,
        Some("think") => Some(true),
        Some("none") => Some(false),
        Some(other) => return Err(anyhow!("--reasoning-parser `{other}`: use think or none")),
    };
    let opts = maxrun_server::ServeOptions {
        tool_parser,
        reasoning,
        allow_extra_request_fields: args.allow_extra_request_fields,
        response_store: maxrun_server::response_store::StoreLimits { entries: args.response_store_entries, bytes: args.response_store_memory },
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        served_model_name: args.served_model_name,
        max_queue: args.max_queue,
        shutdown_timeout: std::time::Duration::from_secs_f64(args.shutdown_timeout),
        threads,
        device: args.device,
        kv_cache_memory: args.kv_cache_memory,
        speculation: args.speculative.config()?,
        draft: open_draft(&args.speculative, args.no_verify)?.map(std::sync::Arc::new),
    };
    maxrun_server::serve(artifact, opts)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "serve"))]
fn serve(_: ServeArgs) -> anyhow::Result<ExitCode> {
    Err(anyhow!("this maxrun was built without the `serve` feature; rebuild it with default features for `maxrun serve`"))
}

/// `maxrun bench --speculative M --prompts FILE`: plain against speculative
/// decoding on the file's prompts (`maxrun::bench_speculation`).
fn bench_speculative(args: &BenchArgs, artifact: &Artifact, config: maxrun_engine::speculate::SpeculationConfig, threads: usize) -> anyhow::Result<ExitCode> {
    let Some(path) = &args.prompts else {
        return Err(anyhow!("--speculative (or --draft) in bench needs --prompts FILE (JSON lines of {{\"prompt\": ..., \"kind\": ...}}, such as ../shared/speculation/prompts.jsonl): drafts need real text to match"));
    };
    if args.compare.is_some() || args.depth > 0 || args.shared_prefix > 0 {
        return Err(anyhow!("--speculative runs the prompts of --prompts; leave out --compare, --depth and --shared-prefix"));
    }
    let h = &artifact.header;
    let tokenizer = maxrun_engine::load_tokenizer(artifact).map_err(|e| anyhow!(e))?;
    let template = std::str::from_utf8(artifact.section(maxrun_runtime::format::SectionKind::ChatTemplate))?;
    let token_text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
    let (bos, eos) = (token_text(h.tokenizer.bos_token_id), token_text(h.tokenizer.eos_token_ids.first().copied()));
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the prompts {}", path.display()))?;
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| anyhow!("{}:{}: not JSON: {e}", path.display(), n + 1))?;
        let Some(prompt) = v["prompt"].as_str() else {
            return Err(anyhow!("{}:{}: no string field `prompt`", path.display(), n + 1));
        };
        let kind = v["kind"].as_str().unwrap_or("prompts").to_string();
        let ids = if args.no_chat_template || template.is_empty() {
            tokenizer.encode(prompt, true)
        } else {
            let rendered = maxrun_runtime::chat::render(template, &[maxrun_runtime::chat::Message::new("user", prompt)], true, &bos, &eos).map_err(|e| anyhow!("the chat template failed: {e}"))?;
            tokenizer.encode(rendered.as_str(), false)
        }
        .map_err(|e| anyhow!("{}:{}: tokenizing: {e}", path.display(), n + 1))?
        .get_ids()
        .to_vec();
        fits_benchmark(&args.artifact, artifact, ids.len() as u64 + args.generated_tokens)?;
        prompts.push(maxrun::bench_speculation::Prompt { kind, ids });
    }
    if prompts.is_empty() {
        return Err(anyhow!("{}: no prompts", path.display()));
    }
    let concurrency = args.concurrency.unwrap_or(1).max(1);
    let open_batched = || -> anyhow::Result<Engine<'_>> {
        let (executor, _) = maxrun_runtime::runner::open_executor(artifact, threads, args.device, args.kv_cache_memory)?;
        Ok(Engine::batched(ModelFacts::of(artifact), executor, tokenizer.clone()))
    };
    // Plain decoding at its fastest: the single-stream plans for one prompt at a time.
    let mut plain = if concurrency == 1 {
        let (runner, _) = open_bench_runner(artifact, threads, args.device)?;
        Engine::serial(ModelFacts::of(artifact), Box::new(runner), tokenizer.clone())
    } else {
        open_batched()?
    };
    let draft = open_draft(&args.speculative, args.no_verify)?;
    let mut speculative = open_batched()?;
    match &draft {
        Some(d) => {
            let model = maxrun_engine::draft::DraftModel::of(maxrun_runtime::runner::open_draft_executor(artifact, d, threads, args.device, args.kv_cache_memory).map_err(|e| anyhow!(e))?);
            speculative.speculate_with_draft(config, model).map_err(|e| anyhow!(e))?;
        }
        None => speculative.speculate(config).map_err(|e| anyhow!(e))?,
    }
    let cfg = maxrun::bench_speculation::SpeculationBenchConfig { prompts, generated_tokens: args.generated_tokens as usize, concurrency, rounds: args.repetitions as usize };
    let method = match &args.speculative.draft {
        Some(d) => format!("draft model {}", d.display()),
        None => format!("ngram {}", args.speculative.ngram),
    };
    let report = maxrun::bench_speculation::speculation(&mut plain, &mut speculative, &cfg, &h.model.name, &method)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", maxrun::bench_speculation::render_speculation(&report));
    }
    Ok(ExitCode::SUCCESS)
}

/// `maxrun bench --concurrency N`: the batched engine with N sequences.
fn bench_concurrency(args: &BenchArgs, artifact: &Artifact, n: usize, threads: usize) -> anyhow::Result<ExitCode> {
    if n == 0 {
        return Err(anyhow!("--concurrency must be at least 1"));
    }
    if args.compare.is_some() || args.depth > 0 {
        return Err(anyhow!("--concurrency runs one artifact from an empty cache; leave out --compare and --depth"));
    }
    if args.generated_tokens == 0 || args.prompt_tokens + args.shared_prefix == 0 {
        return Err(anyhow!("--concurrency needs -n of at least 1 and a prompt (-p or --shared-prefix)"));
    }
    fits_benchmark(&args.artifact, artifact, args.shared_prefix + args.prompt_tokens + args.generated_tokens)?;
    let tokenizer = maxrun_engine::load_tokenizer(artifact).map_err(|e| anyhow!(e))?;
    let (executor, note) = maxrun_runtime::runner::open_executor(artifact, threads, args.device, args.kv_cache_memory)?;
    if let Some(note) = note {
        eprintln!("maxrun bench: {note}");
    }
    let mut engine = Engine::batched(ModelFacts::of(artifact), executor, tokenizer);
    let cfg = maxrun::bench::ConcurrencyConfig {
        sequences: n,
        prompt_tokens: args.prompt_tokens,
        generated_tokens: args.generated_tokens,
        shared_prefix: args.shared_prefix,
        repetitions: args.repetitions,
    };
    let h = &artifact.header;
    if args.profile {
        engine.enable_profile();
    }
    let report = maxrun::bench::concurrency(&mut engine, cfg, &h.model.name, h.model.vocab_size)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", maxrun::bench::render_concurrency(&report));
    }
    if args.profile {
        eprint!("{}", render_profile(&engine.profile()));
    }
    Ok(ExitCode::SUCCESS)
}

/// Opens the session a benchmark runs on, printing why `auto` fell back to the CPU.
fn open_bench_runner<'a>(artifact: &'a Artifact, threads: usize, device: Device) -> anyhow::Result<(Runner<'a>, Option<String>)> {
    let (runner, note) = Runner::open(artifact, threads, device)?;
    if let Some(note) = &note {
        eprintln!("maxrun bench: {note}");
    }
    Ok((runner, note))
}

/// An artifact's runner as perplexity sees it: every call a fresh sequence.
struct FreshSequence<'r, 'a> {
    runner: &'r mut Runner<'a>,
    vocab: usize,
}

impl maxrun::perplexity::SequenceLogits for FreshSequence<'_, '_> {
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn logits(&mut self, ids: &[u32]) -> Result<&[f32], maxrun::perplexity::ModelError> {
        self.runner.reset();
        Ok(self.runner.forward(ids)?)
    }
}

/// An artifact to score, its weights checked, with its tokenizer, the BOS
/// each chunk starts with and the tokenizer's fingerprint.
fn open_scored(path: &std::path::Path, no_verify: bool) -> anyhow::Result<(Artifact, tokenizers::Tokenizer, Option<u32>, String)> {
    let artifact = Artifact::open(path)?;
    if !no_verify {
        verify_weights(&artifact)?;
    }
    if artifact.header.model.embedding_width.is_some() {
        return Err(anyhow!("{} is a sentence encoder; perplexity needs a text generator", path.display()));
    }
    let json = artifact.tokenizer_json()?;
    let tokenizer: tokenizers::Tokenizer = json.parse().map_err(|e| anyhow!("{}: the artifact's tokenizer does not load: {e}", path.display()))?;
    let bos = maxrun::perplexity::added_bos(&tokenizer, artifact.header.tokenizer.bos_token_id);
    let fingerprint = maxrun_runtime::artifact::tokenizer_fingerprint(json);
    Ok((artifact, tokenizer, bos, fingerprint))
}

/// The tokens of `-f TEXT` (tokenized by `tokenizer`) or of `--token-ids-file`, and that file.
fn perplexity_tokens(args: &PerplexityArgs, tokenizer: &tokenizers::Tokenizer, vocab: usize) -> anyhow::Result<Option<(PathBuf, Vec<u32>)>> {
    let (path, ids) = match (&args.file, &args.token_ids_file) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading the text {}", path.display()))?;
            if text.trim().is_empty() {
                return Err(anyhow!("{}: the text is empty; give a text of at least --ctx tokens", path.display()));
            }
            let ids = tokenizer.encode(text.as_str(), true).map_err(|e| anyhow!("{}: tokenizing: {e}", path.display()))?.get_ids().to_vec();
            (path, ids)
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading --token-ids-file {}", path.display()))?;
            (path, maxrun::perplexity::parse_token_ids(path, &text, vocab)?)
        }
        (None, None) => return Ok(None),
    };
    if ids.is_empty() {
        return Err(anyhow!("{}: no tokens; give a text of at least --ctx tokens", path.display()));
    }
    Ok(Some((path.clone(), ids)))
}

/// `maxrun perplexity`: see `maxrun::perplexity` for the definitions.
fn perplexity(args: PerplexityArgs) -> anyhow::Result<ExitCode> {
    use maxrun::perplexity::{evaluate, render, Base, BaseHeader, BaseReader, BaseWriter, Chunks};
    let threads = threads(args.threads)?;
    let reading_base = args.kl_divergence.then_some(args.kl_divergence_base.as_ref()).flatten();
    if args.file.is_none() && args.token_ids_file.is_none() && reading_base.is_none() {
        return Err(usage("give the text: maxrun perplexity MODEL.mef -f TEXT (or --token-ids-file FILE)"));
    }
    let writing_base = args.kl_divergence_base.as_ref().filter(|_| !args.kl_divergence);
    let mut inputs = vec![args.artifact.clone()];
    inputs.extend(args.file.iter().chain(&args.token_ids_file).chain(&args.base).cloned());
    if let Some(out) = writing_base {
        maxrun_runtime::output::check_output("--kl-divergence-base", out, &inputs).map_err(|e| anyhow!(e))?;
    }
    // A missing text is refused before the weights checksum takes its seconds.
    for path in args.file.iter().chain(&args.token_ids_file) {
        std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    }
    let (artifact, tokenizer, bos, fingerprint) = open_scored(&args.artifact, args.no_verify)?;
    let h = &artifact.header;
    let vocab = h.model.vocab_size as usize;
    let text = perplexity_tokens(&args, &tokenizer, vocab)?;
    let max_length = h.max_length as usize;
    if let Some(ctx) = args.ctx.filter(|&c| c > max_length) {
        return Err(anyhow!(
            "--ctx {ctx}: {} runs at most {max_length} tokens; give --ctx {max_length} or less, or recompile with --model-override transformer.max_length={ctx}",
            args.artifact.display()
        ));
    }
    let name = args.artifact.display().to_string();
    let plan_text = |ctx: usize| -> anyhow::Result<(Chunks, Vec<u32>)> {
        let (path, ids) = text.as_ref().expect("a text or a base to read");
        Ok((Chunks::plan(path, ids.len(), ctx, args.chunks, bos)?, ids.clone()))
    };
    let default_ctx = maxrun::perplexity::DEFAULT_CTX.min(max_length);
    let mut reader = None;
    let mut other = None;
    let (chunks, tokens) = if let Some(path) = reading_base {
        let r = BaseReader::open(path)?;
        let given = text.as_ref().map(|(p, ids)| (p.as_path(), ids.as_slice()));
        let planned = r.plan(vocab, &fingerprint, bos, args.ctx, args.chunks, given)?;
        if planned.0.ctx > max_length {
            return Err(anyhow!("{}: the base's chunks of {} tokens do not fit {name}'s context of {max_length}", path.display(), planned.0.ctx));
        }
        reader = Some(r);
        planned
    } else if let Some(base_path) = &args.base {
        let (base, base_tokenizer, base_bos, _) = open_scored(base_path, args.no_verify)?;
        if base.header.model.vocab_size != h.model.vocab_size || base_bos != bos {
            return Err(anyhow!(
                "--base {}: its vocabulary ({} tokens, BOS {:?}) is not {name}'s ({vocab} tokens, BOS {bos:?}); compare artifacts of one tokenizer",
                base_path.display(),
                base.header.model.vocab_size,
                base_bos,
            ));
        }
        let base_max = base.header.max_length as usize;
        if let Some(ctx) = args.ctx.filter(|&c| c > base_max) {
            return Err(anyhow!("--ctx {ctx}: --base {} runs at most {base_max} tokens; give --ctx {base_max} or less", base_path.display()));
        }
        if let Some(file) = &args.file {
            let theirs = perplexity_tokens(&args, &base_tokenizer, vocab)?.map(|(_, ids)| ids);
            if theirs.as_ref() != text.as_ref().map(|(_, ids)| ids) {
                return Err(anyhow!("--base {}: its tokenizer splits {} into other tokens than {name}'s does; compare artifacts of one tokenizer", base_path.display(), file.display()));
            }
        }
        other = Some(base);
        plan_text(args.ctx.unwrap_or(default_ctx.min(base_max)))?
    } else {
        plan_text(args.ctx.unwrap_or(default_ctx))?
    };
    let mut writer = match writing_base {
        Some(path) => {
            maxrun_runtime::output::remove_temp_files_on_signals("maxrun", "no base file was written");
            let source = text.as_ref().map(|(p, _)| p.display().to_string()).unwrap_or_default();
            let header = BaseHeader {
                ctx: chunks.ctx,
                chunks: chunks.count,
                vocab,
                first: chunks.first(),
                bos,
                tokenizer: fingerprint.clone(),
                model: h.model.name.clone(),
                artifact: name.clone(),
                text: source,
            };
            let mb = (chunks.count * chunks.scored() * maxrun::perplexity::record_bytes(vocab)) as f64 / 1e6;
            eprintln!("maxrun perplexity: writing the base to {} ({mb:.0} MB)", path.display());
            Some(BaseWriter::create(path, &header, chunks.used(&tokens))?)
        }
        None => None,
    };
    eprintln!(
        "maxrun perplexity: {} chunks of {} tokens ({} scored each){}",
        chunks.count,
        chunks.ctx,
        chunks.scored(),
        if chunks.bos.is_some() { ", each starting with BOS" } else { "" }
    );
    let (mut runner, note) = Runner::open(&artifact, threads, args.device)?;
    if let Some(note) = note {
        eprintln!("maxrun: {note}");
    }
    let mut model = FreshSequence { runner: &mut runner, vocab };
    let mut base_runner = match &other {
        Some(b) => {
            let (r, note) = Runner::open(b, threads, args.device)?;
            if let Some(note) = note {
                eprintln!("maxrun: --base: {note}");
            }
            Some(r)
        }
        None => None,
    };
    let mut base_model = base_runner.as_mut().map(|r| FreshSequence { runner: r, vocab });
    let base = match (&mut writer, &mut reader, &mut base_model) {
        (Some(w), _, _) => Base::Save(w),
        (_, Some(r), _) => Base::File(r),
        (_, _, Some(m)) => Base::Model(args.base.as_ref().expect("--base").display().to_string(), m),
        _ => Base::None,
    };
    let bar = indicatif::ProgressBar::with_draw_target(Some(chunks.count as u64), indicatif::ProgressDrawTarget::stderr());
    bar.set_style(indicatif::ProgressStyle::with_template("perplexity {bar:30} {pos}/{len} chunks, {msg} (eta {eta})").expect("a valid template"));
    let report = evaluate(&name, &mut model, &tokens, &chunks, base, threads, &mut |_, ppl| {
        bar.inc(1);
        bar.set_message(format!("PPL {ppl:.4}"));
    })?;
    bar.finish_and_clear();
    if let Some(w) = writer {
        w.finish()?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(ExitCode::SUCCESS)
}

fn inspect(args: InspectArgs) -> anyhow::Result<ExitCode> {
    let artifact = Artifact::open(&args.artifact)?;
    let mut report = maxrun_runtime::inspect::report(&artifact);
    if args.verify {
        verify_weights(&artifact)?;
        report["verified"] = serde_json::json!(true);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", maxrun::inspect_text::render_text(&report));
        if args.verify {
            println!("{:<22} all section checksums match", "verified");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn run(cli: RunArgs) -> anyhow::Result<ExitCode> {
    let Some(artifact_path) = cli.artifact.clone() else {
        return Err(usage("give an artifact: maxrun OUT.mef --prompt TEXT (or `maxrun inspect OUT.mef`)"));
    };
    if !cli.chat && cli.system.is_some() {
        return Err(usage("--system sets the system message of a --chat session; add --chat, or put the text in --prompt"));
    }
    let has_input = cli.prompt.is_some() || cli.token_ids.is_some() || cli.chat || cli.embed.is_some() || cli.embed_file.is_some();
    if !has_input {
        return Err(usage("give --prompt TEXT or --token-ids 1,2,3 (or --chat; --embed TEXT for an encoder)"));
    }
    check_range("temperature", cli.temperature, 0.0, None)?;
    check_range("top-p", cli.top_p, 0.0, Some(1.0))?;
    check_range("min-p", cli.min_p, 0.0, Some(1.0))?;
    check_range("repeat-penalty", cli.repeat_penalty, 0.0, None)?;
    if cli.repeat_penalty == Some(0.0) {
        return Err(anyhow!("--repeat-penalty 0 must be greater than 0 (1 is off)"));
    }
    if cli.stops.iter().any(String::is_empty) {
        return Err(anyhow!("--stop needs a non-empty string"));
    }
    // Refused before anything loads; the warning comes when the session opens.
    maxrun_runtime::pool::thread_count("--threads", cli.threads).map_err(|e| anyhow!(e))?;
    if let Some(path) = &cli.dump_logits {
        maxrun_runtime::output::check_output("--dump-logits", path, std::slice::from_ref(&artifact_path)).map_err(|e| anyhow!(e))?;
        maxrun_runtime::output::remove_temp_files_on_signals("maxrun", "no logits file was written");
    }
    let artifact = cli.memory.open(&artifact_path, matches!(cli.device, Device::Gpu(_)))?;
    let h = &artifact.header;
    // The weights checksum on a second thread while the tokenizer loads (which
    // takes longer for small models): nothing runs on damaged weights, and the
    // first token comes no later (docs/performance.md).
    let (tokenizer, verified) = std::thread::scope(|scope| {
        let check = (!cli.no_verify).then(|| scope.spawn(|| artifact.verify_weights(&mut |_, _| {})));
        let tokenizer = artifact.tokenizer_json().map_err(anyhow::Error::from).and_then(|json| {
            json.parse::<tokenizers::Tokenizer>()
                .map_err(|e| anyhow!("{}: the artifact's tokenizer does not load: {e}", artifact_path.display()))
        });
        let verified = check.map_or(Ok(()), |c| c.join().expect("the weights check does not panic"));
        (tokenizer, verified)
    });
    verified?;
    let mut tokenizer = tokenizer?;
    if cli.embed.is_some() || cli.embed_file.is_some() {
        return embed(&cli, &artifact, &mut tokenizer);
    }
    if h.model.embedding_width.is_some() {
        return Err(anyhow!("{} is a sentence encoder: use --embed TEXT or --embed-file FILE", artifact_path.display()));
    }
    if cli.chat {
        return chat(&cli, &artifact, tokenizer);
    }
    let ids: Vec<u32> = match (&cli.prompt, &cli.token_ids) {
        (Some(p), _) => tokenizer.encode(p.as_str(), !cli.no_special_tokens).map_err(|e| anyhow!("tokenizing the prompt: {e}"))?.get_ids().to_vec(),
        (None, Some(ids)) => ids.clone(),
        (None, None) => return Err(usage("give --prompt TEXT or --token-ids 1,2,3")),
    };
    if ids.is_empty() {
        return Err(anyhow!("the prompt is empty: it has no tokens to condition on"));
    }
    if ids.len() as u64 > h.max_length {
        eprintln!("prompt is too long: {} tokens exceeds the maximum context length of {} tokens", ids.len(), h.max_length);
        return Ok(ExitCode::from(EXIT_PROMPT_TOO_LONG));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as u64 >= h.model.vocab_size) {
        return Err(anyhow!("--token-ids: token id {bad} is outside the vocabulary of {} tokens", h.model.vocab_size));
    }
    let speculation = cli.speculative.config()?;
    if let (Some(config), None) = (&speculation, &cli.dump_logits) {
        let max_new = cli.max_new_tokens.or(h.generation.max_new_tokens).unwrap_or(128) as usize;
        let params = generation_params(&cli, &h.generation, max_new)?;
        let draft = open_draft(&cli.speculative, cli.no_verify)?;
        let engine = speculative_engine(&artifact, draft.as_ref(), &cli, tokenizer, config)?;
        return generate_speculative(engine, &cli, ids, params, h.max_length);
    }
    let mut session = open_runner(&artifact, &cli)?;

    if let Some(path) = &cli.dump_logits {
        let logits = session.forward(&ids)?.to_vec();
        maxrun_runtime::npy::write_f32(path, &[ids.len(), h.model.vocab_size as usize], &logits)
            .with_context(|| format!("writing {}", path.display()))?;
        return Ok(ExitCode::SUCCESS);
    }

    let max_new = cli.max_new_tokens.or(h.generation.max_new_tokens).unwrap_or(128) as usize;
    let params = generation_params(&cli, &h.generation, max_new)?;
    if max_new == 0 {
        eprintln!("prompt: {} tokens | -n 0: nothing generated (the prompt was not run)", ids.len());
        return Ok(ExitCode::SUCCESS);
    }
    let mut engine = Engine::serial(ModelFacts::of(&artifact), Box::new(session), tokenizer);
    engine.submit(Request::new(ids.clone(), params)).map_err(|e| submit_error(&cli, e))?;
    let (usage, reason) = print_reply(&mut engine, cli.no_stream)?;
    if reason == maxrun_engine::FinishReason::Length && usage.completion_tokens < max_new {
        eprintln!("note: stopped at the artifact's maximum context length of {} tokens", h.max_length);
    }
    let decode_tokens = usage.completion_tokens.saturating_sub(1);
    let runner = engine.runner().expect("a serial engine");
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | time to first token: {:.0} ms | generated: {} tokens, {:.1} tok/s | {} | plan runs: prefill {}, decode {}",
        ids.len(),
        ids.len() as f64 / usage.time_to_first_token,
        usage.time_to_first_token * 1e3,
        usage.completion_tokens,
        if decode_tokens > 0 { decode_tokens as f64 / usage.decode_seconds } else { 0.0 },
        runner.describe(),
        runner.counts().prefill,
        runner.counts().decode,
    );
    if cli.profile {
        eprint!("{}", render_profile(&runner.profile()));
    }
    Ok(ExitCode::SUCCESS)
}

/// The draft model's artifact for `--draft`, its weights checked unless `--no-verify`.
fn open_draft(args: &SpeculativeArgs, no_verify: bool) -> anyhow::Result<Option<Artifact>> {
    let Some(path) = &args.draft else { return Ok(None) };
    let a = Artifact::open(path).map_err(|e| anyhow!("--draft: {e}"))?;
    if !no_verify {
        a.verify_weights(&mut |_, _| {}).map_err(|e| anyhow!("--draft: {e}"))?;
    }
    Ok(Some(a))
}

/// The batched engine on `artifact` with speculative decoding `config`, its
/// drafts from `draft` where given.
fn speculative_engine<'a>(artifact: &'a Artifact, draft: Option<&'a Artifact>, cli: &RunArgs, tokenizer: tokenizers::Tokenizer, config: &maxrun_engine::speculate::SpeculationConfig) -> anyhow::Result<Engine<'a>> {
    let (executor, note) = maxrun_runtime::runner::open_executor(artifact, threads(cli.threads)?, cli.device, None)
        .map_err(|e| anyhow!("--speculative verifies drafts in batch steps, which need the artifact's batch plans: {e}"))?;
    if let Some(note) = note {
        eprintln!("maxrun: {note}");
    }
    let mut engine = Engine::batched(ModelFacts::of(artifact), executor, tokenizer);
    match draft {
        Some(d) => {
            let model = maxrun_engine::draft::DraftModel::of(maxrun_runtime::runner::open_draft_executor(artifact, d, threads(cli.threads)?, cli.device, None).map_err(|e| anyhow!(e))?);
            engine.speculate_with_draft(config.clone(), model).map_err(|e| anyhow!(e))?;
        }
        None => engine.speculate(config.clone()).map_err(|e| anyhow!(e))?,
    }
    if cli.verbose {
        eprintln!("maxrun: {}; {}", artifact.cpu_variant_note(), engine.describe());
    }
    if cli.profile {
        engine.enable_profile();
    }
    Ok(engine)
}

/// `--prompt` with `--speculative`: one request through the batched engine,
/// streamed as a plain run is, then the speculation's figures on stderr.
fn generate_speculative(mut engine: Engine<'_>, cli: &RunArgs, ids: Vec<u32>, params: GenerationParams, max_length: u64) -> anyhow::Result<ExitCode> {
    let max_new = params.max_tokens;
    engine.submit(Request::new(ids.clone(), params)).map_err(|e| submit_error(cli, e))?;
    let (usage, reason) = print_reply(&mut engine, cli.no_stream)?;
    if reason == maxrun_engine::FinishReason::Length && usage.completion_tokens < max_new {
        eprintln!("note: stopped at the artifact's maximum context length of {max_length} tokens");
    }
    let s = engine.stats();
    let decode_tokens = usage.completion_tokens.saturating_sub(1);
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | time to first token: {:.0} ms | generated: {} tokens, {:.1} tok/s | {} | speculative: {} drafted, {} accepted ({:.0}%), {} verifications, {:.2} tokens per pass",
        ids.len(),
        ids.len() as f64 / usage.time_to_first_token,
        usage.time_to_first_token * 1e3,
        usage.completion_tokens,
        if decode_tokens > 0 { decode_tokens as f64 / usage.decode_seconds } else { 0.0 },
        engine.describe(),
        s.draft_tokens,
        s.accepted_tokens,
        if s.draft_tokens > 0 { 100.0 * s.accepted_tokens as f64 / s.draft_tokens as f64 } else { 0.0 },
        s.verifications,
        // Each verification gives its accepted drafts and one token; a plain step one.
        if decode_tokens > 0 { decode_tokens as f64 / (decode_tokens as u64).saturating_sub(s.accepted_tokens).max(1) as f64 } else { 0.0 },
    );
    if cli.profile {
        eprint!("{}", render_profile(&engine.profile()));
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs the engine's one request to its end, its text on stdout as it comes
/// (or with `--no-stream` at the end), the line ended as [`TextOut::finish`]
/// says; returns its usage and why it ended.
fn print_reply(engine: &mut Engine<'_>, no_stream: bool) -> anyhow::Result<(maxrun_engine::Usage, maxrun_engine::FinishReason)> {
    let mut out = std::io::stdout().lock();
    let mut text_out = TextOut::new(no_stream);
    let finished = loop {
        let mut finished = None;
        for event in engine.step()? {
            match event {
                Event::Token { text, .. } => text_out.push(&mut out, &text)?,
                Event::Finished { text, usage, reason, .. } => {
                    text_out.push(&mut out, &text)?;
                    finished = Some((usage, reason));
                }
                Event::Logits { .. } | Event::PromptLogprob { .. } => {}
            }
        }
        if let Some(f) = finished {
            break f;
        }
    };
    text_out.finish(&mut out)?;
    Ok(finished)
}

/// A `--prompt` run's text on stdout, streamed or (`--no-stream`) held to the
/// end, and where its line ends.
struct TextOut {
    held: String,
    no_stream: bool,
    /// The text so far does not end with a line end.
    line_open: bool,
}

impl TextOut {
    fn new(no_stream: bool) -> TextOut {
        TextOut { held: String::new(), no_stream, line_open: false }
    }

    fn push(&mut self, out: &mut impl Write, text: &str) -> anyhow::Result<()> {
        if let Some(last) = text.chars().last() {
            self.line_open = last != '\n';
        }
        print_text(out, &mut self.held, text, self.no_stream)
    }

    /// Writes what was held and ends the text's line, so that the figures
    /// that follow on stderr start a line of their own: on a terminal stdout
    /// with a line end there; otherwise stdout keeps exactly the generated
    /// text, and the line end goes to stderr when both streams reach the same
    /// file or pipe (`2>&1`, `&> log`).
    fn finish(self, out: &mut std::io::StdoutLock<'_>) -> anyhow::Result<()> {
        out.write_all(self.held.as_bytes())?;
        let terminal = out.is_terminal();
        if terminal {
            writeln!(out)?;
        }
        out.flush()?;
        if !terminal && self.line_open && stdout_and_stderr_meet() {
            eprintln!();
        }
        Ok(())
    }
}

/// Whether stdout and stderr are the same open file (device and inode).
fn stdout_and_stderr_meet() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let id = |fd: std::os::fd::BorrowedFd<'_>| {
        let file = std::fs::File::from(fd.try_clone_to_owned().ok()?);
        file.metadata().ok().map(|m| (m.dev(), m.ino()))
    };
    matches!((id(std::io::stdout().as_fd()), id(std::io::stderr().as_fd())), (Some(a), Some(b)) if a == b)
}

/// Prints `text` now, or with `--no-stream` keeps it in `held` for the end.
fn print_text(out: &mut impl Write, held: &mut String, text: &str, no_stream: bool) -> anyhow::Result<()> {
    if no_stream {
        held.push_str(text);
    } else if !text.is_empty() {
        out.write_all(text.as_bytes())?;
        out.flush()?;
    }
    Ok(())
}

/// `--chat`: reads user messages from stdin, answers each with the chat template
/// applied to the whole conversation. The engine's serial backend keeps the
/// conversation's tokens in the KV cache and runs only what a new turn adds.
fn chat(cli: &RunArgs, artifact: &Artifact, tokenizer: tokenizers::Tokenizer) -> anyhow::Result<ExitCode> {
    use maxrun_runtime::chat::{render, Message};
    use std::io::BufRead;
    let h = &artifact.header;
    let template = std::str::from_utf8(artifact.section(maxrun_runtime::format::SectionKind::ChatTemplate))?;
    if template.is_empty() {
        return Err(anyhow!("{} has no chat template; use --prompt", artifact.path.display()));
    }
    let token_text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
    let (bos, eos_text) = (token_text(h.tokenizer.bos_token_id), token_text(h.tokenizer.eos_token_ids.first().copied()));
    let max_new = cli.max_new_tokens.or(h.generation.max_new_tokens).unwrap_or(256) as usize;
    let draft = open_draft(&cli.speculative, cli.no_verify)?;
    let mut engine = match cli.speculative.config()? {
        // The batched engine's prefix cache keeps the conversation's earlier turns.
        Some(config) => speculative_engine(artifact, draft.as_ref(), cli, tokenizer, &config)?,
        None => Engine::serial(ModelFacts::of(artifact), Box::new(open_runner(artifact, cli)?), tokenizer),
    };
    let mut messages: Vec<Message> = cli.system.iter().map(|s| Message::new("system", s)).collect();
    let interactive = std::io::stdin().is_terminal();
    let mut out = std::io::stdout().lock();
    let mut turn = 0u64;
    if interactive {
        eprint!("> ");
    }
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        turn += 1;
        messages.push(Message::new("user", line.trim_end()));
        let prompt = render(template, &messages, true, &bos, &eos_text).map_err(|e| anyhow!("the chat template failed: {e}"))?;
        let ids = engine.tokenizer().encode(prompt.as_str(), false).map_err(|e| anyhow!("tokenizing: {e}"))?.get_ids().to_vec();
        if ids.len() as u64 + 1 > h.max_length {
            eprintln!("the conversation reached the maximum context length of {} tokens", h.max_length);
            break;
        }
        // Each turn has a prompt's parameters, with a seed of its own (the
        // conversation replays the same with the same --seed).
        let mut params = generation_params(cli, &h.generation, max_new)?;
        params.seed = cli.seed.wrapping_add(turn - 1);
        engine.submit(Request::new(ids, params)).map_err(|e| submit_error(cli, e))?;
        let (mut reply, mut held) = (String::new(), String::new());
        let usage = loop {
            let mut finished = None;
            for event in engine.step()? {
                match event {
                    Event::Token { text, .. } => {
                        reply.push_str(&text);
                        print_text(&mut out, &mut held, &text, cli.no_stream)?;
                    }
                    Event::Finished { text, usage, .. } => {
                        reply.push_str(&text);
                        print_text(&mut out, &mut held, &text, cli.no_stream)?;
                        finished = Some(usage);
                    }
                    Event::Logits { .. } | Event::PromptLogprob { .. } => {}
                }
            }
            if let Some(u) = finished {
                break u;
            }
        };
        out.write_all(held.as_bytes())?;
        writeln!(out)?;
        out.flush()?;
        eprintln!(
            "turn {turn}: {} prompt tokens ({} reused from the cache), {} generated",
            usage.prompt_tokens - usage.cached_tokens,
            usage.cached_tokens,
            usage.completion_tokens
        );
        messages.push(Message::new("assistant", &reply));
        if interactive {
            eprint!("> ");
        }
    }
    if cli.profile {
        eprint!("{}", render_profile(&engine.profile()));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--embed` / `--embed-file`: one JSON array per text, in input order.
fn embed(cli: &RunArgs, artifact: &Artifact, tokenizer: &mut tokenizers::Tokenizer) -> anyhow::Result<ExitCode> {
    let h = &artifact.header;
    if h.model.embedding_width.is_none() {
        return Err(anyhow!("{} is a text generator, not a sentence encoder; --embed needs an encoder artifact", artifact.path.display()));
    }
    let texts: Vec<String> = match (&cli.embed, &cli.embed_file) {
        (Some(t), _) => vec![t.clone()],
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading {}", f.display()))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect(),
        (None, None) => unreachable!("checked by the caller"),
    };
    // Sentence encoders see exactly their tokens: the tokenizer's fixed padding is for batching.
    tokenizer.with_padding(None);
    let mut ids = Vec::with_capacity(texts.len());
    for text in &texts {
        let t = tokenizer.encode(text.as_str(), true).map_err(|e| anyhow!("tokenizing: {e}"))?.get_ids().to_vec();
        if t.len() as u64 > h.max_length {
            eprintln!("prompt is too long: {} tokens exceeds the maximum context length of {} tokens", t.len(), h.max_length);
            return Ok(ExitCode::from(EXIT_PROMPT_TOO_LONG));
        }
        ids.push(t);
    }
    // The encoder batch plan on the CPU, many lines per step; `--check-nan`
    // scans each launch of the single-sequence plans, one line per step.
    let executor: Box<dyn EncodeExecutor + '_> = if cli.check_nan {
        Box::new(OnePerStep::new(open_runner(artifact, cli)?, h.max_length))
    } else {
        let (executor, note) = maxrun_runtime::runner::open_encoder(artifact, threads(cli.threads)?, cli.device)?;
        if let Some(note) = note {
            eprintln!("maxrun: {note}");
        }
        if cli.verbose {
            eprintln!("maxrun: {}; {}", artifact.cpu_variant_note(), executor.describe());
        }
        executor
    };
    let mut embedder = Embedder::new(executor, EncoderFacts::of(artifact).expect("checked above"));
    if cli.profile && !cli.check_nan {
        embedder.enable_profile();
    }
    let mut out = std::io::stdout().lock();
    // A bounded number of lines at a time, so that output streams for a long file.
    for chunk in ids.chunks(1024) {
        for embedding in embedder.embed_all(chunk)? {
            writeln!(out, "{}", serde_json::to_string(&embedding)?)?;
        }
    }
    if cli.profile && !cli.check_nan {
        eprint!("{}", render_profile(&embedder.profile()));
    }
    Ok(ExitCode::SUCCESS)
}

/// Sampling settings: the flags, else the artifact's generation defaults, else greedy.
fn sampling_params(cli: &RunArgs, g: &maxrun_runtime::format::GenerationDefaults) -> SamplingParams {
    SamplingParams {
        temperature: cli.temperature.or(g.temperature).unwrap_or(0.0),
        top_k: cli.top_k.or(g.top_k).unwrap_or(0),
        top_p: cli.top_p.or(g.top_p).unwrap_or(1.0),
        min_p: cli.min_p.or(g.min_p).unwrap_or(0.0),
    }
}

/// A refused request, with the flag and file of a grammar that does not build.
fn submit_error(cli: &RunArgs, e: maxrun_engine::SubmitError) -> anyhow::Error {
    let source = match (&cli.json_schema, &cli.grammar, &cli.regex) {
        (Some(p), _, _) => format!("--json-schema {}", p.display()),
        (_, Some(p), _) => format!("--grammar {}", p.display()),
        (_, _, Some(r)) => format!("--regex {r:?}"),
        _ => String::new(),
    };
    match e {
        maxrun_engine::SubmitError::Grammar(_) if !source.is_empty() => anyhow!("{source}: {e}"),
        e => e.into(),
    }
}

/// What the command line asks of each generation (`--prompt` and every `--chat` turn).
fn generation_params(cli: &RunArgs, g: &maxrun_runtime::format::GenerationDefaults, max_tokens: usize) -> anyhow::Result<GenerationParams> {
    use maxrun_engine::constrain::Grammar;
    let read = |p: &PathBuf| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let grammar = match (&cli.json_schema, &cli.grammar, &cli.regex) {
        (Some(p), _, _) => {
            let schema = serde_json::from_str(&read(p)?).with_context(|| format!("--json-schema {}: not JSON", p.display()))?;
            Some(Grammar::JsonSchema(schema))
        }
        (_, Some(p), _) => Some(Grammar::Lark(read(p)?)),
        (_, _, Some(r)) => Some(Grammar::Regex(r.clone())),
        _ => None,
    };
    Ok(GenerationParams {
        sampling: sampling_params(cli, g),
        seed: cli.seed,
        max_tokens,
        stop: cli.stops.clone(),
        ignore_eos: cli.ignore_eos,
        // The checkpoint's generation_config.json default, unless the flag is given.
        repeat_penalty: cli.repeat_penalty.or(g.repetition_penalty).filter(|&r| r != 1.0),
        grammar,
        ..GenerationParams::default()
    })
}

/// The `--profile` table: kernels ranked by total time, per plan.
fn render_profile(rows: &[maxrun_runtime::executor::ProfileRow]) -> String {
    let mut out = String::new();
    for plan in ["prefill", "decode"] {
        let total: f64 = rows.iter().filter(|r| r.plan == plan).map(|r| r.seconds).sum();
        if total == 0.0 {
            continue;
        }
        out.push_str(&format!("\n{plan}: {:.1} ms in kernels\n", total * 1e3));
        out.push_str(&format!(
            "  {:<48} {:<12} {:>7} {:>10} {:>6} {:>10} {:>8}\n",
            "kernel", "family", "calls", "total ms", "%", "MB moved", "GB/s"
        ));
        for r in rows.iter().filter(|r| r.plan == plan) {
            out.push_str(&format!(
                "  {:<48} {:<12} {:>7} {:>10.2} {:>5.1}% {:>10.1} {:>8.1}\n",
                r.kernel,
                r.family,
                r.calls,
                r.seconds * 1e3,
                100.0 * r.seconds / total,
                r.bytes as f64 / 1e6,
                r.bytes as f64 / 1e9 / r.seconds.max(1e-12)
            ));
        }
        out.push_str("  (MB moved: weights read plus outputs written)\n");
    }
    out
}
